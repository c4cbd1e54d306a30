"""Which attention kernel and whether Liger: ``train.attn_implementation`` and ``train.use_liger_kernel``.

Pure decisions over what the node has (``cuda``, which packages import), so they are tested on
plain values; ``node_facts()`` is the one place that looks. Measured on one H200 (docs/benchmarks.md,
notes/deepspeed-and-gpu.md): packed fixed-size rows run 46k useful tokens/s with flex_attention and
34k with sdpa; flex recompiles for every new shape, so it is only "auto"'s choice with packing (static
shapes). flash-attention, where installed, reads packed rows from ``position_ids`` (one flattened row,
see ``packing``). On the CPU sdpa is the fast correct one.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from ..errors import SwiftSlurmError

FLASH = ("flash_attention_2", "flash_attention_3")
FLASH_PACKAGE = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}


class KernelError(SwiftSlurmError):
    """A kernel the spec asks for that this node cannot run."""

    exit_code = 2


@dataclass(frozen=True)
class NodeFacts:
    cuda: bool
    flash_attn: bool = False
    flash_attn_3: bool = False
    liger: bool = False


def node_facts(cuda: bool) -> NodeFacts:
    def has(name: str) -> bool:
        return importlib.util.find_spec(name) is not None

    return NodeFacts(cuda=cuda, flash_attn=has("flash_attn"), flash_attn_3=has("flash_attn_interface"),
                     liger=has("liger_kernel"))


def resolve_attention(requested: str, packing: bool, node: NodeFacts) -> tuple[str, str]:
    """(transformers attn_implementation, why) for ``train.attn_implementation``; KernelError when impossible."""
    if requested == "auto":
        if not node.cuda:
            return "sdpa", "auto: sdpa on the CPU"
        if node.flash_attn:
            return "flash_attention_2", "auto: flash-attn is installed"
        if packing:
            return "flex_attention", "auto: flex_attention for packed rows of one static shape"
        return "sdpa", "auto: sdpa (flex_attention would recompile for every padded batch shape)"
    if requested in FLASH:
        if not node.cuda:
            raise KernelError(f"train.attn_implementation = {requested!r} needs a CUDA GPU", "no CUDA device on this node",
                              'use "auto" or "sdpa" for CPU runs')
        installed = node.flash_attn if requested == "flash_attention_2" else node.flash_attn_3
        if not installed:
            raise KernelError(f"train.attn_implementation = {requested!r} needs the {FLASH_PACKAGE[requested]} package",
                              "it is not installed in the nodes' Python", 'install it there, or use "auto" (flex_attention or sdpa)')
    return requested, "as set in the spec"


def resolve_liger(requested: bool | str, zero_stage: int, node: NodeFacts) -> tuple[bool, str]:
    """(use Liger, why) for ``train.use_liger_kernel``; KernelError when ``true`` cannot work here."""
    if requested == "auto":
        if not node.cuda:
            return False, "auto: off on the CPU (Liger's kernels are Triton GPU kernels)"
        if not node.liger:
            return False, "auto: off, liger-kernel is not installed"
        if zero_stage >= 3:
            return False, "auto: off under ZeRO-3 (the fused loss reads an lm_head shard that ZeRO-3 left empty)"
        # Measured on one H200 (0.5B shape, packed rows of 8192, flex_attention; docs/benchmarks.md): Liger cut
        # peak memory about in half but useful tokens/s by 23% (46.1k -> 35.4k). Speed is the default's goal.
        return False, ("auto: off (measured on an H200: about half the memory, 23% fewer useful tokens/s); "
                       "set use_liger_kernel = true when memory, not speed, is the limit")
    if not requested:
        return False, "off in the spec"
    if not node.liger:
        raise KernelError("train.use_liger_kernel = true but liger-kernel is not installed", "no liger_kernel module in the nodes' Python",
                          'pip install "swiftslurm[liger]" (or liger-kernel) there, or set use_liger_kernel = "auto"')
    if not node.cuda:
        raise KernelError("train.use_liger_kernel = true needs a CUDA GPU", "no CUDA device on this node",
                          'set use_liger_kernel = "auto" (off on the CPU) or false')
    if zero_stage >= 3:
        raise KernelError("train.use_liger_kernel = true does not work under ZeRO-3",
                          "the fused linear cross-entropy reads lm_head.weight, which ZeRO-3 leaves as an empty shard",
                          'use deepspeed = "zero2", or use_liger_kernel = "auto"/false')
    return True, "on in the spec"
