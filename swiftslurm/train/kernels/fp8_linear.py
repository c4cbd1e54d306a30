"""torchao's ``Float8Linear``, and a frozen weight's cheaper backward (``fp8.py`` decides which layers).

torchao's matmul always computes the weight's gradient: under LoRA the frozen base would run three FP8 GEMMs a layer
(output, input gradient, weight gradient) where bf16 runs two, and keep the layer's input alive for the third. A
converted layer here checks its weight at each call: a weight that trains takes torchao's own path; a frozen one
(LoRA's base, a frozen vision tower) takes ``_FrozenWeightMatmul``, whose forward is torchao's and whose backward
computes the input's gradient only, with torchao's casts (the ``grad_input`` half of its backward).
"""

from __future__ import annotations

from typing import Callable

import torch
from torchao.float8 import Float8LinearConfig, convert_to_float8_training
from torchao.float8.config import ScalingType
from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args
from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim, hp_tensor_to_float8_dynamic
from torchao.float8.float8_training_tensor import GemmInputRole


class _Unsaved:
    """A stand-in autograd context for torchao's forward: it keeps nothing for a backward that never runs."""

    def save_for_backward(self, *tensors) -> None:
        pass


def _cast(t: torch.Tensor, cast, mm_config, role, axis: int, round_pow2: bool) -> torch.Tensor:
    if cast.scaling_type is ScalingType.DISABLED:
        return t
    return hp_tensor_to_float8_dynamic(t, cast.target_dtype, mm_config, gemm_input_role=role,
                                       scaling_granularity=cast.scaling_granularity,
                                       axiswise_dim=get_maybe_axiswise_dim(axis, cast.scaling_granularity),
                                       round_scales_to_power_of_2=round_pow2)


@torch._dynamo.allow_in_graph
class _FrozenWeightMatmul(torch.autograd.Function):
    """``input @ weight_t`` in FP8 for a weight without a gradient: the backward's one GEMM is the input's."""

    @staticmethod
    def forward(ctx, input_hp, weight_hp_t, linear_mm_config, config):
        ctx.save_for_backward(weight_hp_t)  # not the input: no weight gradient reads it
        ctx.linear_mm_config, ctx.config = linear_mm_config, config
        return matmul_with_hp_or_float8_args.forward(_Unsaved(), input_hp, weight_hp_t, linear_mm_config, config)

    @staticmethod
    def backward(ctx, grad_output):
        (weight_hp_t,) = ctx.saved_tensors
        c, mm = ctx.config, ctx.linear_mm_config
        shape = grad_output.shape
        grad = _cast(grad_output.reshape(-1, shape[-1]), c.cast_config_grad_output, mm, GemmInputRole.GRAD_OUTPUT, -1,
                     c.round_scales_to_power_of_2)
        weight = _cast(weight_hp_t, c.cast_config_weight_for_grad_input, mm, GemmInputRole.WEIGHT, -1,
                       c.round_scales_to_power_of_2)
        grad_input = torch.mm(grad, weight.t())
        return grad_input.reshape(*shape[:-1], grad_input.shape[-1]), None, None, None


class FrozenAwareFloat8Linear(Float8Linear):
    """torchao's layer; a frozen weight skips the weight-gradient GEMM (the module docstring)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.weight.requires_grad:
            return super().forward(input)
        if torch.is_autocast_enabled():  # as torchao's forward: the output in autocast's dtype
            input = input.to(torch.get_autocast_gpu_dtype())
        output = _FrozenWeightMatmul.apply(input, self.weight.t(), self.linear_mm_config, self.config)
        if self.bias is not None:
            output = output + self.bias.to(output.dtype)
        return output


def convert(model: torch.nn.Module, recipe: str, keep: Callable[[str, torch.nn.Linear], bool], emulate: bool = False) -> int:
    """torchao's swap of the linear layers ``keep(fqn, module)`` accepts, each then a ``FrozenAwareFloat8Linear``."""
    import dataclasses

    config = Float8LinearConfig.from_recipe_name(recipe)
    if emulate:
        config = dataclasses.replace(config, emulate=True)
    convert_to_float8_training(model, module_filter_fn=lambda mod, fqn: isinstance(mod, torch.nn.Linear) and keep(fqn, mod),
                               config=config)
    converted = [m for m in model.modules() if type(m) is Float8Linear]
    for m in converted:
        m.__class__ = FrozenAwareFloat8Linear
    return len(converted)
