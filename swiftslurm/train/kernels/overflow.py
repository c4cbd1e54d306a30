"""Skip a non-finite bf16 step on the GPU itself, without DeepSpeed's two host syncs per step.

Before every bf16 step DeepSpeed 0.19's ZeRO-1/2 optimizer (``stage_1_and_2.DeepSpeedZeroOptimizer.step``) scans
every gradient of its partition for inf/NaN (``check_overflow``: about eight small kernels per parameter, then
``.item()``), computes the global gradient norm, and tests that norm on the host too (``is_invalid_grad_norm``:
``bool`` of a GPU tensor). Each test waits for the GPU; the clipping, the Adam update and the bf16 copy are then
issued while it sits idle. On one H200 the 0.5B shape's step took 25 ms with this module's skip against 60-62 ms
with DeepSpeed's check (docs/benchmarks.md, "Fifth run"); turned off instead, DeepSpeed applies a NaN gradient.

``skip_nonfinite_on_device`` keeps the skip and drops those two syncs, and the third that DeepSpeed's clipping makes
(``unscale_and_clip_grads`` tests the norm on the host to clip by inf where it is not finite): the same arithmetic,
with that test as a ``torch.where`` on the device, where the method still has the shape it relies on (``CLIP_NEEDS``;
else DeepSpeed's clipping is kept). It turns DeepSpeed's check off on that one optimizer object and gives the torch
optimizer under it, fused AdamW (the Trainer's default), the norm's verdict as ``found_inf``, the device-side flag
torch's fused kernels take from ``GradScaler``: where the global norm is not finite the kernel leaves weights,
moments and step count as they were, and nothing reads the flag on the host. The norm is all-reduced, so every
rank skips the same step. The clipping before it multiplies NaN gradients by zero (still NaN), which the skipped
update never reads.

One difference: the Trainer holds the learning-rate schedule back on a step DeepSpeed reports as skipped
(``overflow``); a skip made on the device is not known on the host, so the schedule advances one step.

Nothing changes unless all of this holds (else DeepSpeed keeps its own check): the exact ZeRO-1/2 class, bf16,
DeepSpeed's check on (``[deepspeed.bf16] check_grad_overflow = false`` means "apply non-finite steps", and is
left so), the norm computed (``zero_optimization.compute_grad_norm``), no optimizer offload, a fused torch
Adam/AdamW under it (``found_inf`` is a fused-kernel argument), and a DeepSpeed ``step`` that still sets the norm
before the update (its source is checked, through ``functools.wraps`` wrappers). fp16 (loss scaling) and ZeRO-3
are left alone. ``kept_reason`` says which condition kept DeepSpeed's check (the trainer logs it on rank 0).
"""

from __future__ import annotations

import inspect
from typing import Any

# get_grad_norm_direct's L2 branch: per-gradient norms in the norm dtype, their squares summed, all-reduced over the
# data-parallel and model-parallel groups, the root taken, inf/NaN masked (what norm_in_one_pass keeps, in that order)
NORM_NEEDS = ("param_gradients = (g for g in gradients if not getattr(g, \"_zero_padding\", False))",
              "if hasattr(p, PIPE_REPLICATED) and p.ds_pipe_replicated:",
              "if is_model_parallel_parameter(p) or (self.model_parallel_rank == 0):",
              "torch.linalg.vector_norm(g.data.to(get_norm_dtype()).detach(),",
              "total_norm = torch.stack(all_norms).pow(norm_type).sum().float()",
              "dist.all_reduce(total_norm, op=dist.ReduceOp.SUM, group=self.dp_process_group)",
              "self._model_parallel_all_reduce(tensor=total_norm, op=dist.ReduceOp.SUM)",
              "total_norm = total_norm.pow(1. / norm_type)",
              "mask_nan_or_inf_with_val_inplace(total_norm, device=self.device)")

# step() must set the norm before it runs the torch optimizer, and read check_grad_overflow at step time
STEP_NEEDS = ("self._global_grad_norm = scaled_global_grad_norm", "self._optimizer_step(i)", "if self.check_grad_overflow:")
# unscale_and_clip_grads must still clip by the norm, an invalid one read as inf, and divide by the combined scale
CLIP_NEEDS = ("if is_invalid_grad_norm(clip_norm):", "clip = ((clip_norm / self.loss_scale) + 1e-6) / self.clip_grad",
              "clip = torch.clamp(clip, min=1.0)", "combined_scale = clip * self.loss_scale", ".mul_(1. / combined_scale)")


def _zero_optimizer(optimizer: Any):
    """DeepSpeed's ZeRO-1/2 optimizer behind ``optimizer`` (itself, or Accelerate's wrapper of it), else None."""
    try:
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    except ImportError:
        return None
    for candidate in (optimizer, getattr(optimizer, "optimizer", None)):
        if type(candidate) is DeepSpeedZeroOptimizer:  # not a subclass (ZenFlow's step differs)
            return candidate
    return None


def _source_with(zero: Any, method: str, needs: tuple[str, ...]) -> str | None:
    """The source of DeepSpeed's ``method`` on ``zero``'s class (through ``functools.wraps`` wrappers) when it still
    has every line of ``needs``; None otherwise, or where it cannot be read."""
    try:
        source = inspect.getsource(getattr(type(zero), method))
    except (OSError, TypeError, AttributeError):
        return None
    return source if all(line in source for line in needs) else None


def _step_order_holds(zero: Any) -> bool:
    source = _source_with(zero, "step", STEP_NEEDS)
    return source is not None and source.index(STEP_NEEDS[0]) < source.index(STEP_NEEDS[1])


def _fused_adam(inner: Any) -> bool:
    import torch

    return (type(inner) in (torch.optim.AdamW, torch.optim.Adam) and bool(inner.defaults.get("fused"))
            and not inner.defaults.get("amsgrad") and not inner.defaults.get("differentiable"))


def _candidate(optimizer: Any):
    """(ZeRO-1/2 optimizer, whether it runs DeepSpeed's bf16 check), or (None, False) where the skip is moot."""
    import torch

    zero = _zero_optimizer(optimizer)
    if zero is None:
        return None, False
    return zero, getattr(zero, "dtype", None) == torch.bfloat16 and getattr(zero, "check_grad_overflow", False) is True


def _blocker(zero: Any) -> str | None:
    """Why the skip cannot move onto the device for this bf16 ZeRO-1/2 optimizer with the check on; None if it can."""
    inner = getattr(zero, "optimizer", None)
    if getattr(zero, "compute_grad_norm", False) is not True:
        return "zero_optimization.compute_grad_norm is off"
    if getattr(zero, "cpu_offload", True) is not False:
        return "the optimizer is offloaded"
    if inner is None or not _fused_adam(inner):
        fused = getattr(inner, "defaults", {}).get("fused")
        return f"the torch optimizer is {type(inner).__name__} (fused={fused}), not a fused torch Adam/AdamW"
    if not _step_order_holds(zero):
        return f"DeepSpeed's ZeRO step ({_deepspeed_version()}) no longer has the shape this relies on"
    return None


def _deepspeed_version() -> str:
    try:
        import deepspeed
    except ImportError:
        return "?"
    return f"deepspeed {deepspeed.__version__}"


def kept_reason(optimizer: Any) -> str | None:
    """Where DeepSpeed's bf16 ZeRO-1/2 check is still on after ``skip_nonfinite_on_device``: why (one phrase);
    None where the skip is on the device or the question does not arise (not ZeRO-1/2 bf16, the check off, or
    the optimizer offloaded to the host, where the update runs after a copy anyway)."""
    zero, checking = _candidate(optimizer)
    if zero is None or not checking or getattr(zero, "_swiftslurm_skip_on_device", False):
        return None
    if getattr(zero, "cpu_offload", False):  # the update runs on the host anyway: the syncs cost nothing there
        return None
    return _blocker(zero)


def skip_nonfinite_on_device(optimizer: Any) -> bool:
    """Move the bf16 inf/NaN skip of DeepSpeed's ZeRO-1/2 optimizer onto the device (module doc); True when done
    (now or before). Idempotent; leaves everything as it was where a condition does not hold (``kept_reason``)."""
    import torch

    zero, checking = _candidate(optimizer)
    if zero is None:
        return False
    if getattr(zero, "_swiftslurm_skip_on_device", False):
        return True
    if not checking or _blocker(zero) is not None:
        return False
    inner = zero.optimizer
    real_step = inner.step

    def step(*args, **kwargs):
        norm = getattr(zero, "_global_grad_norm", None)  # set by this step, before the update
        if norm is not None:  # inf/NaN (or DeepSpeed's -1 for one) -> skip
            norm = torch.as_tensor(norm, dtype=torch.float32, device=zero.device)
            inner.found_inf = (~torch.isfinite(norm) | (norm < 0)).to(torch.float32).reshape(())
        try:
            return real_step(*args, **kwargs)
        finally:
            inner.found_inf = None

    inner.step = step
    zero.check_grad_overflow = False  # read by step() each time: no scan, no host test of the norm
    zero._swiftslurm_skip_on_device = True
    _clip_on_device(zero)
    return True


def _clip_on_device(zero: Any) -> bool:
    """DeepSpeed's ``unscale_and_clip_grads`` without its host test of the norm (module doc); True when installed."""
    import torch

    if _source_with(zero, "unscale_and_clip_grads", CLIP_NEEDS) is None:
        return False

    def unscale_and_clip_grads(grad_groups_flat, total_norm):
        if zero.clip_grad == 0.0 and zero.loss_scale == 1.0:
            return
        combined_scale = zero.loss_scale
        if zero.clip_grad > 0.0:
            norm = torch.as_tensor(total_norm, dtype=torch.float, device=zero.device)
            norm = torch.where(torch.isfinite(norm) & (norm >= 0), norm, torch.full_like(norm, float("inf")))
            clip = torch.clamp(((norm / zero.loss_scale) + 1e-6) / zero.clip_grad, min=1.0)
            combined_scale = clip * zero.loss_scale
        for grad in grad_groups_flat:
            for part in grad if isinstance(grad, list) else [grad]:
                part.data.mul_(1. / combined_scale)

    zero.unscale_and_clip_grads = unscale_and_clip_grads
    zero._swiftslurm_clip_on_device = True
    return True


def norm_in_one_pass(optimizer: Any) -> bool:
    """The global gradient norm of DeepSpeed's ZeRO-1/2 optimizer from one multi-tensor kernel instead of a cast and
    a norm per gradient; True when installed (now or before).

    DeepSpeed 0.19's ``get_grad_norm_direct`` casts every gradient of the partition to fp64 and takes its norm, two
    kernels and ~30 us of Python per tensor: on the 0.5B shape (337 tensors) ~700 launches that the GPU waits for at
    the end of every backward. ``torch._foreach_norm`` takes all the per-gradient norms in one pass (accumulated in
    fp32, as torch's ``clip_grad_norm_`` does); their squares are summed in DeepSpeed's norm dtype and the rest is
    DeepSpeed's own: the same gradients counted (no padding, no pipeline replicas, model-parallel ranks as it has
    them), the same all-reduces, root and inf/NaN mask. The norm then differs from DeepSpeed's in the last digits of
    fp32 (the per-tensor sums of squares), which moves the clipping factor by as much. Installed only where
    ``get_grad_norm_direct`` still has that shape (``NORM_NEEDS``, read through ``functools.wraps`` wrappers), on
    the exact ZeRO-1/2 class (not ZeRO-3, whose norm is computed elsewhere); other norm types go to DeepSpeed's."""
    import torch

    zero = _zero_optimizer(optimizer)
    if zero is None:
        return False
    if getattr(zero, "_swiftslurm_norm_in_one_pass", False):
        return True
    if _source_with(zero, "get_grad_norm_direct", NORM_NEEDS) is None or not hasattr(torch, "_foreach_norm"):
        return False
    import deepspeed.runtime.zero.stage_1_and_2 as s12  # imported already: zero is its class
    deepspeeds = zero.get_grad_norm_direct

    def get_grad_norm_direct(gradients, params, norm_type=2):
        if float(norm_type) != 2.0:
            return deepspeeds(gradients, params, norm_type)
        counted = []
        for g, p in zip((g for g in gradients if not getattr(g, "_zero_padding", False)), params, strict=False):  # as DeepSpeed pairs them
            if hasattr(p, s12.PIPE_REPLICATED) and p.ds_pipe_replicated:
                continue
            if s12.is_model_parallel_parameter(p) or zero.model_parallel_rank == 0:
                counted.append(g.detach())
        if counted:
            norms = torch._foreach_norm(counted, 2.0, dtype=torch.float32)
            total = torch.stack(norms).to(s12.get_norm_dtype()).pow(2).sum().float()
        else:
            total = torch.tensor(0.0, dtype=torch.float32).to(zero.device)
        s12.dist.all_reduce(total, op=s12.dist.ReduceOp.SUM, group=zero.dp_process_group)
        zero._model_parallel_all_reduce(tensor=total, op=s12.dist.ReduceOp.SUM)
        total = total.pow(0.5)
        # DeepSpeed's inf/NaN -> -1 rule, with a Python scalar: its mask_nan_or_inf_with_val_inplace fills from a
        # device tensor it makes from -1.0, a copy and a read that each made the host wait for the whole backward
        return total.masked_fill_(~torch.isfinite(total), -1.0)

    zero.get_grad_norm_direct = get_grad_norm_direct
    zero._swiftslurm_norm_in_one_pass = True
    return True
