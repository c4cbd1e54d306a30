"""``train.fp8``: torchao's float8 training on the model's large linear layers (issue 53).

torchao (``convert_to_float8_training``) swaps an ``nn.Linear`` for its ``Float8Linear``: the weight stays a bf16/fp32
parameter (so optimizer states, checkpoints, resume and export are unchanged, key for key), and each matmul casts its
operands to float8 with a dynamic scale (one per tensor, or per row) and runs on the GPU's FP8 tensor cores. Which
layers, and when, are decided here over plain values:

- ``eligible``: a layer converts when both its dimensions are multiples of 16 (the FP8 GEMM's requirement) and it is
  large enough that the casts pay (torchao's own thresholds, measured by its authors on an H100: its
  ``_auto_filter_for_tensorwise`` / ``_rowwise``). Never the LM head and a reward model's score (the loss reads their
  output at full precision), LoRA's adapters (they stay bf16), a mixture of experts' router, or a vision tower and its
  projector.
- ``resolve``: ``true`` needs a CUDA GPU with FP8 tensor cores (compute capability 8.9: Ada, or 9.0: Hopper) and
  torchao; ``"auto"`` is off until the benchmark shows a gain (docs/benchmarks.md, FP8).

torchao needs ``torch.compile`` to fuse the casts into the kernels around them (without it FP8 "may actually be
slower"): with FP8 on, the decoder layers are compiled as with ``train.compile``. The CPU has no FP8 GEMMs; torchao's
emulation (``SWIFTSLURM_TEST_FP8_EMULATE=1``, for the tests only) runs the same casts in fp32 so the wiring, the
checkpoints and the resume are tested on the CPU.
"""

from __future__ import annotations

import os

from .choose import KernelError

FP8_CAPABILITY = (8, 9)  # Ada (sm89) and Hopper (sm90) and newer have FP8 tensor cores (torch._scaled_mm needs them)
GEMM_MULTIPLE = 16  # torch._scaled_mm: both dimensions of each operand a multiple of 16
# torchao's auto filters (torchao/float8/float8_linear_utils.py, measured on an H100): below these sizes the casts cost
# more than the faster GEMM saves. tensorwise: skip when in_features <= 4096 and out_features <= 1024; rowwise: skip when
# out <= 2048, or in <= 1024, or (out <= 4096 and in <= 2048)
TENSORWISE_SMALL = (4096, 1024)
ROWWISE_MIN_OUT, ROWWISE_MIN_IN, ROWWISE_SMALL = 2048, 1024, (2048, 4096)
# module names that never convert: heads whose output the loss reads at full precision, routers, vision parts
KEPT_NAMES = frozenset({"lm_head", "score", "gate", "router", "visual", "vision_tower", "vision_model",
                        "multi_modal_projector", "merger"})
EMULATE_ENV = "SWIFTSLURM_TEST_FP8_EMULATE"  # tests only: torchao's fp32 emulation of the FP8 casts and GEMMs


def emulated() -> bool:
    return os.environ.get(EMULATE_ENV) == "1"


def eligible(fqn: str, out_features: int, in_features: int, recipe: str = "tensorwise") -> bool:
    """Whether the linear layer ``fqn`` (``out_features`` x ``in_features`` weight) runs in FP8."""
    parts = fqn.split(".")
    if any(p in KEPT_NAMES or p.startswith("lora_") for p in parts):
        return False
    if out_features % GEMM_MULTIPLE or in_features % GEMM_MULTIPLE:
        return False
    if emulated():  # the tests' tiny models: every layer the hardware could take
        return True
    if recipe == "tensorwise":
        return not (in_features <= TENSORWISE_SMALL[0] and out_features <= TENSORWISE_SMALL[1])
    return not (out_features <= ROWWISE_MIN_OUT or in_features <= ROWWISE_MIN_IN
                or (out_features <= ROWWISE_SMALL[1] and in_features <= ROWWISE_SMALL[0]))


def resolve(requested: bool | str, cuda: bool, capability: tuple[int, int] | None, torchao: bool) -> tuple[bool, str]:
    """(FP8 on, why) for ``train.fp8`` on this node; KernelError where ``true`` cannot run here."""
    if requested is False:
        return False, "off in the spec"
    if requested == "auto":
        # an 8B LoRA on an H100 ran 0.57x bf16 with it (docs/benchmarks.md, "FP8"); nothing measured faster yet
        return False, "auto: off (measured slower for an 8B LoRA on an H100, not yet faster anywhere; set train.fp8 = true)"
    if not torchao:
        raise KernelError("train.fp8 = true needs torchao", "no torchao module in the nodes' Python",
                          'pip install "swiftslurm[fp8]" (torchao) there, or set train.fp8 = false')
    if emulated():
        return True, "on, emulated in fp32 (SWIFTSLURM_TEST_FP8_EMULATE: tests only)"
    if not cuda:
        raise KernelError("train.fp8 = true needs a CUDA GPU", "no CUDA device on this node", "set train.fp8 = false for CPU runs")
    if capability is None or capability < FP8_CAPABILITY:
        found = f"compute capability {capability[0]}.{capability[1]}" if capability else "an unknown compute capability"
        raise KernelError("train.fp8 = true needs FP8 tensor cores (an Ada or Hopper GPU, compute capability 8.9 or newer)",
                          f"this node's GPU has {found}", "set train.fp8 = false on these nodes")
    return True, "on in the spec"


def convert(model, recipe: str) -> int:
    """Swap the eligible linear layers of ``model`` for torchao's float8 ones, in place; returns how many. Before
    LoRA wraps the model (peft then wraps the float8 layer as its base) and before DeepSpeed sees it."""
    from . import fp8_linear

    return fp8_linear.convert(model, recipe, lambda fqn, mod: eligible(fqn, mod.out_features, mod.in_features, recipe),
                              emulate=emulated())
