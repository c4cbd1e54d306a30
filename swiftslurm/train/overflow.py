"""Skip a non-finite bf16 step on the GPU itself, without DeepSpeed's two host syncs per step.

Before every bf16 step DeepSpeed 0.19's ZeRO-1/2 optimizer (``stage_1_and_2.DeepSpeedZeroOptimizer.step``) scans
every gradient of its partition for inf/NaN (``check_overflow``: about eight small kernels per parameter, then
``.item()``), computes the global gradient norm, and tests that norm on the host too (``is_invalid_grad_norm``:
``bool`` of a GPU tensor). Each test waits for the GPU; the clipping, the Adam update and the bf16 copy are then
issued while it sits idle. On one H200 the 0.5B shape's step took 26.5 ms with the check off against 49.5 and
61.9 ms with it on (docs/benchmarks.md), but off, DeepSpeed applies a NaN gradient to the weights.

``skip_nonfinite_on_device`` keeps the skip and drops those two syncs (the clipping keeps its own host test of
the norm, as with the check off). It turns DeepSpeed's check off on that one optimizer object and gives the torch
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
before the update (its source is checked). fp16 (loss scaling) and ZeRO-3 are left alone.
"""

from __future__ import annotations

import inspect
from typing import Any

# step() must set the norm before it runs the torch optimizer, and read check_grad_overflow at step time
STEP_NEEDS = ("self._global_grad_norm = scaled_global_grad_norm", "self._optimizer_step(i)", "if self.check_grad_overflow:")


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


def _step_order_holds(zero: Any) -> bool:
    try:
        source = inspect.getsource(type(zero).step)
    except (OSError, TypeError):
        return False
    if not all(line in source for line in STEP_NEEDS):
        return False
    return source.index(STEP_NEEDS[0]) < source.index(STEP_NEEDS[1])


def _fused_adam(inner: Any) -> bool:
    import torch

    return (type(inner) in (torch.optim.AdamW, torch.optim.Adam) and bool(inner.defaults.get("fused"))
            and not inner.defaults.get("amsgrad") and not inner.defaults.get("differentiable"))


def skip_nonfinite_on_device(optimizer: Any) -> bool:
    """Move the bf16 inf/NaN skip of DeepSpeed's ZeRO-1/2 optimizer onto the device (module doc); True when done
    (now or before). Idempotent; leaves everything as it was where a condition does not hold."""
    import torch

    zero = _zero_optimizer(optimizer)
    if zero is None:
        return False
    if getattr(zero, "_swiftslurm_skip_on_device", False):
        return True
    inner = getattr(zero, "optimizer", None)
    if not (getattr(zero, "dtype", None) == torch.bfloat16 and getattr(zero, "check_grad_overflow", False) is True
            and getattr(zero, "compute_grad_norm", False) is True and getattr(zero, "cpu_offload", True) is False
            and inner is not None and _fused_adam(inner) and _step_order_holds(zero)):
        return False
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
    return True
