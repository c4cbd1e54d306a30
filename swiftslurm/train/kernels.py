"""Which attention kernel and whether Liger: ``train.attn_implementation`` and ``train.use_liger_kernel``.

Pure decisions over what the node has (``cuda``, which packages import), so they are tested on
plain values; ``node_facts()`` is the one place that looks. Measured on one H200 through ``swiftslurm submit``
(docs/benchmarks.md, benchmarks/gpu/packing_e2e.py; 0.5B shape, alpaca-length samples): on packed rows of
2048 tokens sdpa with the packed-sequence mask ran 48.8k useful tokens/s and flex_attention 43.4k (flex
also lost 9% on unpacked full rows), so "auto" takes sdpa for rows up to ``FLEX_MIN_ROW`` tokens; on longer
rows the block-diagonal mask leaves most of a row's attention to skip, which flex_attention does and sdpa
does not, so it takes flex there (flex recompiles for every new shape: only with packing, whose rows have
one static shape). flash-attention, where installed, reads packed rows from ``position_ids``; where it is
not, PyTorch's own flash kernel for packed samples (``varlen_attn``, torch >= 2.10; ``train/varlen.py``)
does the same for bf16/fp16 packed rows when asked for: "auto" does not take it, since through
``swiftslurm submit`` on an H200 it ran 36.7k useful tokens/s on rows of 2048 against sdpa's 42.2k in the
same run (its layout copies and GQA repeat cost more than the mask it saves; docs/benchmarks.md). On the CPU
sdpa is the fast correct one.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from ..errors import SwiftSlurmError
from .varlen import NAME as VARLEN
from .varlen import available as varlen_available

FLASH = ("flash_attention_2", "flash_attention_3")
FLEX_MIN_ROW = 4096  # packed rows at least this long go to flex_attention under "auto" (see the docstring)
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
    varlen: bool = False  # torch has torch.nn.attention.varlen.varlen_attn (a CUDA kernel)


def node_facts(cuda: bool) -> NodeFacts:
    def has(name: str) -> bool:
        return importlib.util.find_spec(name) is not None

    return NodeFacts(cuda=cuda, flash_attn=has("flash_attn"), flash_attn_3=has("flash_attn_interface"),
                     liger=has("liger_kernel"), varlen=cuda and varlen_available())


def resolve_attention(requested: str, packing: bool, node: NodeFacts, row_length: int = 0) -> tuple[str, str]:
    """(transformers attn_implementation, why) for ``train.attn_implementation``; KernelError when impossible
    on this node (what the spec alone rules out, e.g. ``varlen_attn`` without packing, ``validate`` refused).
    ``row_length``: tokens per packed row (``train.max_length``)."""
    if requested == "auto":
        if not node.cuda:
            return "sdpa", "auto: sdpa on the CPU"
        if node.flash_attn:
            return "flash_attention_2", "auto: flash-attn is installed"
        if packing and row_length >= FLEX_MIN_ROW:
            return "flex_attention", f"auto: flex_attention for packed rows of {row_length} tokens (>= {FLEX_MIN_ROW})"
        if packing:
            return "sdpa", f"auto: sdpa with the packed-sequence mask for rows of {row_length} tokens (< {FLEX_MIN_ROW})"
        return "sdpa", "auto: sdpa (flex_attention would recompile for every padded batch shape)"
    if (requested in FLASH or requested == VARLEN) and not node.cuda:
        raise KernelError(f"train.attn_implementation = {requested!r} needs a CUDA GPU", "no CUDA device on this node",
                          'use "auto" or "sdpa" for CPU runs')
    if requested in FLASH:
        installed = node.flash_attn if requested == "flash_attention_2" else node.flash_attn_3
        if not installed:
            raise KernelError(f"train.attn_implementation = {requested!r} needs the {FLASH_PACKAGE[requested]} package",
                              "it is not installed in the nodes' Python", 'install it there, or use "auto" (flex_attention or sdpa)')
    if requested == VARLEN and not node.varlen:
        raise KernelError(f"train.attn_implementation = {VARLEN!r} needs torch >= 2.10", "this torch has no torch.nn.attention.varlen",
                          'upgrade torch on the nodes, or use "auto"')
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
        # peak memory about in half but useful tokens/s by 12-23% (46.1k -> 35.4k; 36.7k -> 32.4k). Speed is the default's goal.
        return False, ("auto: off (measured on an H200: about half the memory, 12-23% fewer useful tokens/s); "
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
