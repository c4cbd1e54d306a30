"""Sequence and tensor parallel in the built-in trainer (``[parallel]``): the one seam in ``sft.py``.

- Ulysses SP (``sequence_parallel``): DeepSpeed's ALST pieces through HF Trainer + Accelerate, which
  register ``UlyssesSPAttentionHF`` with transformers, hand DeepSpeed the SP process groups (mpu), wrap
  the train DataLoader in ``UlyssesSPDataLoaderAdapter`` (each sample sharded over the SP group, labels
  pre-shifted) and compute the loss with ``deepspeed_sp_compute_loss`` (token-weighted over the group).
  We pass ``TrainingArguments.parallelism_config``; batches must carry ``position_ids`` (packed rows do;
  the unpacked collator adds them) and a length that divides by the degree.
- AutoTP (``tensor_parallel``): ``tensor_parallel.autotp_size`` in the DeepSpeed config (``dsconfig``);
  the Trainer reads it for its data-parallel size, and DeepSpeed checks that a TP group's inputs agree.
- TiledMLP (``tiled_mlp``, ``tile_mlps``): each gated MLP (Llama, Qwen, Mistral: gate/up/down projections)
  computes its intermediate activations slice by slice of the sequence, ``ceil(seq / hidden)`` slices, the
  same on every rank (MAX over the process group: ZeRO-3 would deadlock on uneven counts), and recomputes
  them in the backward: the peak of the MLP's ``seq x intermediate`` activations divides by the slice count.

The rules ``plan`` checks against a local config.json run here again against the loaded model
(``check_model``): a hub model's heads are only known on the nodes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import SwiftSlurmError
from ..sizing.layout import Layout, keeps_packed_apart, shape_problems
from ..sizing.shape import ShapeError, shape_from_config

if TYPE_CHECKING:
    from ..spec.model import JobSpec


class ParallelError(SwiftSlurmError):
    exit_code = 2


def degrees(spec: JobSpec) -> tuple[int, int]:
    p = spec.parallel
    return p.sequence_parallel, p.tensor_parallel


def degrees_json(spec: JobSpec) -> dict[str, int]:
    """The degrees as checkpoints record them (manifest meta ``parallel``)."""
    sp, tp = degrees(spec)
    return {"sequence_parallel": sp, "tensor_parallel": tp, "expert": spec.parallel.expert}


def global_batch(spec: JobSpec) -> int:
    """Samples (or packed rows) per optimizer step: the data-parallel ranks' micro-batches."""
    t = spec.train
    return Layout(spec.world_size, *degrees(spec), t.per_device_train_batch_size, t.gradient_accumulation_steps).global_batch


def parallelism_config(spec: JobSpec, attn: str):
    """Accelerate's ParallelismConfig for Ulysses SP (None without SP)."""
    sp, _ = degrees(spec)
    if sp == 1:
        return None
    if spec.train.packing and not keeps_packed_apart(attn):
        raise ParallelError(
            f"sequence_parallel = {sp} with packed rows needs flash attention, and this node resolved attention to {attn!r}",
            "the Ulysses wrapper drops the mask that keeps packed samples apart: with sdpa or flex_attention they would attend "
            "to each other", 'train in bf16/fp16 on sm80+ GPUs (attn_implementation = "auto" then takes torch\'s flash kernel, '
            'varlen_attn), or install flash-attn on the nodes, or set train.packing = false')
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    world = spec.world_size
    return ParallelismConfig(sp_backend="deepspeed", sp_size=sp, dp_shard_size=max(1, world // sp),
                             sp_handler=DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True, sp_attn_implementation=attn))


def init_comm(spec: JobSpec) -> None:
    """DeepSpeed's comm layer on the process group TrainingArguments made: the Ulysses groups are built
    through ``deepspeed.comm``, which Accelerate initialises itself only on GPUs (CPU runs: gloo)."""
    sp, _ = degrees(spec)
    if sp > 1:
        import deepspeed

        deepspeed.init_distributed()


def check_model(spec: JobSpec, model) -> None:
    """The head rules against the loaded model's config (exit 2 with the reason, before any step)."""
    sp, tp = degrees(spec)
    if sp == 1 and tp == 1:
        return
    config = getattr(model, "config", None)
    try:
        shape = shape_from_config(config.to_dict(), f"{spec.train.model} config")  # type: ignore[union-attr]  # no config: the AttributeError below
    except (ShapeError, AttributeError) as exc:
        raise ParallelError("cannot read the attention heads of the model for the parallel degrees", str(exc),
                            "use a decoder model with a transformers config (num_attention_heads, ...)") from None
    t = spec.train
    problems = shape_problems(Layout(spec.world_size, sp, tp, t.per_device_train_batch_size, t.gradient_accumulation_steps), shape)
    if problems:
        p = problems[0]
        raise ParallelError(f"{p.path}: {p.what}", p.found, p.hint)


def tile_mlps(spec: JobSpec, model) -> int:
    """``[parallel] tiled_mlp``: route every gated MLP of ``model`` through DeepSpeed's ``TiledMLP``; how many."""
    if not spec.parallel.tiled_mlp:
        return 0
    import types

    count = 0
    for module in model.modules():
        if all(hasattr(module, name) for name in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            module.forward = types.MethodType(_tiled_forward, module)
            count += 1
    if not count:
        raise ParallelError("[parallel] tiled_mlp = true, but the model has no gated MLP to tile",
                            f"{type(model).__name__}: no module with gate_proj, up_proj, down_proj and act_fn",
                            "set tiled_mlp = false for this model")
    return count


def _mlp(module, x):
    return module.down_proj(module.act_fn(module.gate_proj(x)) * module.up_proj(x))


def _tiled_forward(module, x):
    import math

    import torch
    import torch.distributed as tdist
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    slices = max(1, math.ceil(x.shape[-2] / x.shape[-1]))
    if tdist.is_available() and tdist.is_initialized() and tdist.get_world_size() > 1:
        agreed = torch.tensor(slices, device=x.device)
        tdist.all_reduce(agreed, op=tdist.ReduceOp.MAX)
        slices = int(agreed.item())
    return TiledMLP.apply(_mlp, module, x, slices, list(module.parameters()))
