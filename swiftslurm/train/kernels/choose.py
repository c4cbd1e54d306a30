"""Which attention kernel and whether Liger: ``train.attn_implementation`` and ``train.use_liger_kernel``.

Pure decisions over what the node has (``cuda``, which packages import), so they are tested on
plain values; ``node_facts()`` is the one place that looks. Measured on one H200 (docs/benchmarks.md: 0.5B
shape, alpaca-length samples, rows of 2048, bf16, ZeRO-2, through ``swiftslurm submit``): packed rows through
``varlen.py``'s flash node ran 52.5k useful tokens/s where sdpa with the packed-sequence mask (a masked
kernel, no flash) ran 44.7k in the same run, and as fast as the same model on full rows with no samples to
keep apart (1.0x); so "auto" takes it for packed bf16/fp16 rows on GPUs the flash kernel runs on (sm80+;
flash has no fp32). Elsewhere: flash-attention where installed (it reads packed rows from ``position_ids``);
flex_attention for packed rows of ``FLEX_MIN_ROW`` tokens or more (the block-diagonal mask leaves most of a
long row to skip; flex recompiles for every new shape, so only with packing's one static shape); sdpa
otherwise, and on the CPU.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ...errors import SwiftSlurmError
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
    varlen: bool = False  # torch's variable-length flash kernel runs here (a CUDA GPU of sm80 or newer)
    capability: tuple[int, int] | None = None  # the GPU's compute capability (FP8 needs 8.9+)
    torchao: bool = False


def node_facts(cuda: bool) -> NodeFacts:
    def has(name: str) -> bool:
        return importlib.util.find_spec(name) is not None

    varlen, capability = False, None
    if cuda:
        import torch

        major, minor = torch.cuda.get_device_capability()
        capability = (major, minor)
        varlen = varlen_available() and capability >= (8, 0)
    return NodeFacts(cuda=cuda, flash_attn=has("flash_attn"), flash_attn_3=has("flash_attn_interface"),
                     liger=has("liger_kernel"), varlen=varlen, capability=capability, torchao=has("torchao"))


def liger_import_problem(model_type: str | None, table: Mapping[str, Callable[..., Any]] | None = None) -> str | None:
    """Why Liger's patch for ``model_type`` cannot import what it needs with the installed transformers, or None.
    Liger's ``apply_liger_kernel_to_*`` functions import the model's classes and Liger's own forward only when
    called, inside ``Trainer()``, so a Liger older than transformers fails there, after the model loaded
    (liger-kernel 0.8.5 under transformers 5.25: its Qwen2.5-VL forward imports an output class transformers
    renamed; an H100 run, docs/benchmarks.md). The function's imports are tried here, nothing patched. ``table``:
    model type -> apply function (Liger's ``MODEL_TYPE_TO_APPLY_LIGER_FN`` by default)."""
    import ast
    import inspect
    import textwrap

    if table is None:
        try:
            from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
        except Exception as exc:  # noqa: BLE001 -- Liger itself does not import here: no patch of it would run
            return f"{type(exc).__name__}: {exc}"
        table = MODEL_TYPE_TO_APPLY_LIGER_FN
    fn = table.get(model_type or "")
    if fn is None:
        return None
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(getattr(fn, "func", fn)))))
    except (OSError, TypeError, SyntaxError):
        return None  # no source to read: transformers' own call is then the test
    for node in ast.walk(tree):
        try:
            if isinstance(node, ast.Import):
                for alias in node.names:
                    importlib.import_module(alias.name)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                module = importlib.import_module(node.module)
                for alias in node.names:
                    if alias.name != "*" and not hasattr(module, alias.name):
                        _submodule(node.module, alias.name)
        except Exception as exc:  # noqa: BLE001 -- any failure of an import is the answer, in its own words
            return f"{type(exc).__name__}: {exc}"
    return None


def _submodule(module: str, name: str) -> None:
    """``from module import name`` where ``name`` is no attribute yet: a submodule, else Python's own ImportError."""
    try:
        importlib.import_module(f"{module}.{name}")
    except ModuleNotFoundError:
        raise ImportError(f"cannot import name {name!r} from {module!r}") from None


def resolve_attention(requested: str, packing: bool, node: NodeFacts, row_length: int = 0,
                      half: bool = False) -> tuple[str, str]:
    """(transformers attn_implementation, why) for ``train.attn_implementation``; KernelError when impossible
    on this node (what the spec alone rules out, e.g. ``varlen_attn`` without packing, ``validate`` refused).
    ``row_length``: tokens per packed row (``train.max_length``); ``half``: bf16 or fp16 training."""
    if requested == "auto":
        if not node.cuda:
            return "sdpa", "auto: sdpa on the CPU"
        if node.flash_attn:
            return "flash_attention_2", "auto: flash-attn is installed"
        if packing and half and node.varlen:
            return VARLEN, "auto: torch's flash kernel for packed samples (varlen_attn)"
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
        raise KernelError(f"train.attn_implementation = {VARLEN!r} needs torch's flash kernel on an sm80+ GPU (A100, H100 or newer)",
                          "this node's GPU or torch build has none", 'use "auto" (sdpa or flex_attention there)')
    return requested, "as set in the spec"


def fit_to_model(requested: str, attn: str, why: str, head_dim: int) -> tuple[str, str]:
    """``resolve_attention``'s choice checked against the loaded model: the flash kernel of ``varlen_attn`` takes
    head dimensions that are multiples of 8 up to 256. "auto" then falls back to sdpa with the packed-sequence
    mask; an explicit ``varlen_attn`` is refused (KernelError)."""
    if attn != VARLEN or (head_dim % 8 == 0 and head_dim <= 256):
        return attn, why
    found = f"this model's head dimension is {head_dim}; the flash kernel takes multiples of 8 up to 256"
    if requested == "auto":
        return "sdpa", f"auto: sdpa with the packed-sequence mask ({found})"
    raise KernelError(f"train.attn_implementation = {VARLEN!r} cannot run this model", found,
                      'use "auto" or "sdpa"')


def fit_liger_to_model(requested: bool | str, liger: dict[str, bool] | None, why: str,
                       model_type: str | None, import_problem: str | None = None) -> tuple[dict[str, bool] | None, str]:
    """``resolve_liger``'s choice checked against the loaded model's type: Liger patches only the types of its own
    table (``sizing.liger``, read from the installed package) and does nothing, at info level, for the rest. So
    "auto" turns off there and says so (the banner and the summary then say what really runs), and an explicit
    ``true`` is refused (KernelError) rather than trained without what it asked for. ``import_problem``
    (``liger_import_problem``): why Liger's patch for this type cannot import what it needs here, ruled the same way."""
    from ...sizing import liger as liger_types

    if liger is None:
        return liger, why
    if import_problem is not None:
        found = f"Liger's patch for model type {model_type!r} fails to import with this transformers ({import_problem})"
        if requested == "auto":
            return None, f"auto: off ({found})"
        raise KernelError("train.use_liger_kernel = true cannot run this model", found,
                          'set use_liger_kernel = "auto" or false, or install a liger-kernel made for this transformers')
    if liger_types.patches(model_type, look=True):
        return liger, why
    found = f"Liger has no kernels for model type {model_type!r}" if model_type else "the model's config names no model_type"
    if requested == "auto":
        return None, f"auto: off ({found})"
    raise KernelError("train.use_liger_kernel = true cannot run this model", found + " (Liger would leave the model as it is)",
                      'set use_liger_kernel = "auto" or false')


# Liger's kernels as transformers' ``liger_kernel_config``: ``true`` takes Liger's defaults (its fused linear
# cross-entropy too); ``"auto"`` takes the ones that fuse the model's elementwise work and leaves the loss as it is.
LIGER_ALL: dict[str, bool] = {}
LIGER_FAST = {"rope": True, "rms_norm": True, "swiglu": True, "cross_entropy": False, "fused_linear_cross_entropy": False}


def liger_names(config: dict[str, bool] | None) -> str:
    """What a Liger config turns on, for the banner and the summary: "off", "all", or the kernels' names."""
    if config is None:
        return "off"
    return "all" if config == LIGER_ALL else "+".join(k for k, on in config.items() if on)


def resolve_liger(requested: bool | str, zero_stage: int, node: NodeFacts, compiled: bool = False) -> tuple[dict[str, bool] | None, str]:
    """(Liger config for transformers, or None = off; why) for ``train.use_liger_kernel``; KernelError when
    ``true`` cannot work here. ``compiled``: ``train.compile`` (validate refuses it with ``true``)."""
    if requested == "auto":
        if compiled:  # an H200 run: dynamo failed inside LigerRMSNormFunction (AssertionError) before the first step
            return None, "auto: off with train.compile (torch.compile fuses the same elementwise work, and cannot trace Liger's kernels)"
        if not node.cuda:
            return None, "auto: off on the CPU (Liger's kernels are Triton GPU kernels)"
        if not node.liger:
            return None, "auto: off, liger-kernel is not installed"
        if zero_stage >= 3:
            return None, "auto: off under ZeRO-3 (Liger was measured under ZeRO-2 only)"
        # Measured on one H200 (0.5B shape, packed rows of 2048, varlen_attn; docs/benchmarks.md): the fused loss cut
        # peak memory about in half but useful tokens/s by 12-23%; RMSNorm + RoPE + SwiGLU alone took a forward +
        # backward of the model from 100.4 to 88.2 ms and peak memory from 31.7 to 28.5 GB, and end to end won two
        # of three same-lease pairs (+11.6%, +3.4%, -6.8%). So auto takes those three and leaves the loss alone.
        return LIGER_FAST, ("auto: Liger's RMSNorm, RoPE and SwiGLU; not its fused loss (half the memory, 12-23% fewer "
                            "tokens/s on an H200): set use_liger_kernel = true when memory is the limit")
    if not requested:
        return None, "off in the spec"
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
    return LIGER_ALL, "on in the spec"
