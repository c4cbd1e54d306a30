"""``train.fp8 = true`` at validate: what the nodes would refuse after the queue wait (``train/kernels/fp8.py`` decides on
the node; a GPU older than Ada/Hopper is seen only there, by its compute capability).

torchao's float8 training casts from bf16 or fp32 (not fp16), needs the FP8 GEMMs of a GPU, and compiles the decoder
layers (``torch.compile``), which cannot trace Liger's kernels.
"""

from __future__ import annotations

import importlib.util

from ..errors import Problem
from .view import SpecView


def fp8_problems(spec: SpecView, read_disk: bool) -> list[Problem]:
    t = spec.train
    if t.fp8 is not True:
        return []
    out = []
    if not spec.slurm.gpus_per_node:
        out.append(Problem("train.fp8", "FP8 matmuls run on a GPU's FP8 tensor cores (Ada or Hopper); the CPU has none",
                           "fp8 = true with slurm.gpus_per_node = 0", "set train.fp8 = false (or \"auto\") for CPU jobs"))
    if t.fp16:
        out.append(Problem("train.fp8", "torchao's float8 training casts from bf16 or fp32 master precision, not fp16",
                           "fp8 = true with fp16 = true", "set bf16 = true (and fp16 = false), or fp8 = false"))
    if t.use_liger_kernel is True:
        out.append(Problem("train.fp8", "FP8 compiles the decoder layers (torch.compile fuses torchao's casts), and "
                           "torch.compile cannot trace Liger's kernels", "fp8 = true with use_liger_kernel = true",
                           'drop use_liger_kernel ("auto" leaves it off with FP8), or fp8 = false'))
    if read_disk and importlib.util.find_spec("torchao") is None:
        out.append(Problem("train.fp8", "FP8 training is torchao's float8 layers, and the nodes would not find torchao",
                           "no torchao module in this Python", 'pip install "swiftslurm[fp8]" (torchao), or fp8 = false'))
    return out
