"""A task's sizing as ``plan`` shows it: the model shape, the parallel rules, the memory estimate.

Takes the spec (typed by what it reads: ``view.SpecView``) and the merged DeepSpeed config by attribute and key
(this package sits below ``spec`` and imports none of it). ``shape_of`` reads a local model's config.json when ``read_disk``; the rest is pure.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import Problem
from ..fsutil import DIRECTORY, path_kind
from . import layout as lay
from . import liger
from .fp8 import fp8_problems
from .memory import GIB, MemoryEstimate, Settings, advice, estimate
from .shape import BUILT_IN_SHAPES, ModelShape, ShapeError, read_config_json
from .tasks import holds_reference_copy
from .view import SpecView

OWN_TRAINER = ("sft", "pt")  # the tasks our SFT Trainer runs (packing, sequence/tensor parallel, Liger); the rest go through TRL
UNKNOWN_SHAPE = ("the model's shape is unknown (a hub id that is not on disk): no memory estimate, and the heads are "
                 "checked against the parallel degrees on the nodes. Set train.model_shape to have both at validate")


@dataclass(frozen=True)
class Sizing:
    layout: lay.Layout
    shape: ModelShape | None
    memory: MemoryEstimate | None
    advice: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    gpus: bool = True  # a CPU job (gpus_per_node = 0) gets the estimate but no GPU-memory warning
    cautions: list[str] = field(default_factory=list)  # what only the nodes can decide
    checkpointing: Checkpointing | None = None  # train.gradient_checkpointing = "auto" decided; None = set in the spec

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"layout": self.layout.to_json(), "shape": self.shape.to_json() if self.shape else None,
                               "advice": self.advice}
        out.update(self.memory.to_json() if self.memory else {"fits": None})
        out["notes"] = self.notes  # the estimate's own notes and the sizing's (Liger's model type), over the estimate's
        if self.checkpointing is not None:
            out["gradient_checkpointing"] = self.checkpointing.to_json()
        return out

    def warnings(self) -> list[str]:
        """The plan's warning when the estimate exceeds the GPU's memory (naming what would fit)."""
        m = self.memory
        if m is None or m.fits or not self.gpus:
            return list(self.cautions)
        fix = ("; these would fit: " + ", ".join(self.advice)) if self.advice else \
            "; no ZeRO setting fits: add GPUs, raise sequence_parallel, or shorten train.max_length"
        return list(self.cautions) + [f"estimated GPU memory per rank {m.total_bytes / GIB:.1f} GiB exceeds slurm.gpu_memory_gb = "
                f"{m.gpu_memory_bytes / GIB:g}{fix}"]


def layout_of(spec: SpecView) -> lay.Layout:
    t = spec.train
    return lay.Layout(spec.world_size, spec.parallel.sequence_parallel, spec.parallel.tensor_parallel,
                      t.per_device_train_batch_size, t.gradient_accumulation_steps, spec.parallel.expert)


def shape_of(spec: SpecView, read_disk: bool) -> tuple[ModelShape | None, list[Problem]]:
    """The shape: a local model's config.json (when ``read_disk``), a built-in tiny model, or train.model_shape."""
    model = spec.train.model
    if model in BUILT_IN_SHAPES:
        return BUILT_IN_SHAPES[model], []
    if read_disk and model and path_kind(model) == DIRECTORY:  # a name too long is a hub id's problem, for check_files
        try:
            shape = read_config_json(model)
        except ShapeError as exc:
            return None, [Problem("train.model", "cannot read the model's shape from its config.json", str(exc),
                                  "fix the file, or point train.model at a directory with a transformers config.json")]
        if shape is not None:
            return shape, []
    ms = spec.train.model_shape
    return (ms.shape() if ms is not None else None), []


def _zero(ds: dict[str, Any]) -> tuple[int, bool, bool]:
    found = ds.get("zero_optimization")
    zero: dict[str, Any] = found if isinstance(found, dict) else {}
    dev = lambda key: isinstance(zero.get(key), dict) and zero[key].get("device") in ("cpu", "nvme")  # noqa: E731
    stage = zero.get("stage", 0)
    return (stage if isinstance(stage, int) else 0), dev("offload_optimizer"), dev("offload_param")


def size_task(spec: SpecView, ds: dict[str, Any], read_disk: bool) -> tuple[Sizing | None, list[Problem]]:
    """(the task's sizing, its problems). Problems: the parallel rules, and an unreadable local config.json."""
    layout = layout_of(spec)
    problems = lay.degree_problems(layout)
    if problems:
        return None, problems
    stage, off_opt, off_param = _zero(ds)
    t = spec.train
    packs = t.packing and getattr(t, "task", "sft") in OWN_TRAINER  # DPO never packs (the trainer logs packing off)
    problems += lay.training_problems(layout, stage, t.train_type, t.attn_implementation, packs, t.max_length,
                                      gpus=bool(spec.slurm.gpus_per_node))
    if layout.model_parallel > 1 and t.deepspeed == "none":
        key = "parallel.sequence_parallel" if layout.sequence_parallel > 1 else "parallel.tensor_parallel"
        problems.append(Problem(key, "sequence and tensor parallel run inside DeepSpeed (Ulysses and AutoTP build their "
                                "process groups in the DeepSpeed engine); plain DDP has neither",
                                f'train.deepspeed = "none" with sequence_parallel {layout.sequence_parallel}, tensor_parallel '
                                f"{layout.tensor_parallel}", 'use a ZeRO preset (deepspeed = "zero2", or "zero1" for tensor '
                                "parallel), or set the degrees to 1"))
    if layout.model_parallel > 1 and getattr(t, "task", "sft") not in OWN_TRAINER:
        problems.append(Problem("parallel", f"sequence/tensor parallel is built for SFT; task = {t.task!r} goes through TRL's "
                                "trainer, whose batches the Ulysses adapter and AutoTP do not see",
                                f"sequence_parallel {layout.sequence_parallel}, tensor_parallel {layout.tensor_parallel}",
                                "drop [parallel] for this run (ZeRO-3 with offload shards the DPO model and its reference)"))
    problems += lay.expert_problems(layout, stage, bool(spec.slurm.gpus_per_node))
    if layout.expert_parallel > 1 and t.deepspeed == "none":
        problems.append(Problem("parallel.expert", "AutoEP replaces the MoE layers inside the DeepSpeed engine; plain DDP "
                                "has no expert parallel", f'train.deepspeed = "none" with expert = {layout.expert_parallel}',
                                'use a ZeRO preset (deepspeed = "zero1" or "zero2"), or set expert = 1'))
    if spec.parallel.tiled_mlp and t.deepspeed == "none":
        problems.append(Problem("parallel.tiled_mlp", "TiledMLP runs one backward per slice of the sequence; DeepSpeed's ZeRO "
                                "waits for the last slice before reducing a gradient, plain DDP would reduce it at the first",
                                'train.deepspeed = "none"', 'use a ZeRO preset (zero1, zero2, zero3), or tiled_mlp = false'))
    if t.use_liger_kernel is True and stage >= 3:
        problems.append(Problem("train.use_liger_kernel", "Liger's fused linear cross-entropy reads lm_head.weight, which ZeRO-3 "
                                "leaves as an empty shard on every rank", f"use_liger_kernel = true with ZeRO stage {stage}",
                                'use a ZeRO-2 preset (deepspeed = "zero2"), or use_liger_kernel = "auto"/false'))
    problems += fp8_problems(spec, read_disk)
    cautions = []
    if layout.sequence_parallel > 1 and packs and spec.slurm.gpus_per_node and t.attn_implementation == "auto":
        cautions.append(f"sequence_parallel = {layout.sequence_parallel} with packed rows needs a kernel that keeps samples apart: "
                        "attn_implementation = \"auto\" takes torch's flash kernel (varlen_attn) on sm80+ GPUs (A100, H100) "
                        "with bf16/fp16" + ("" if t.bf16 or t.fp16 else " (this spec trains in fp32: set bf16 = true)") +
                        ", else flash-attn where installed; a node with neither refuses to start (packing = false trains with sdpa)")
    shape, shape_problems = shape_of(spec, read_disk)
    problems += shape_problems
    auto = t.gradient_checkpointing == "auto"
    gpus = bool(spec.slurm.gpus_per_node)
    if shape is None and layout.expert_parallel > 1 and not shape_problems:
        cautions.append(f"parallel.expert = {layout.expert_parallel}: the model's shape is unknown, so whether it has experts, "
                        "how many, and an AutoEP preset is left to DeepSpeed on the nodes; set train.model_shape (experts, "
                        "experts_per_token, model_type) to have them checked at validate")
    if shape is None:
        decided = Checkpointing(True, "on (auto): " + ("the model's shape is unknown, so no estimate says it fits without"
                                                     if gpus else CPU_CHECKPOINTING), t.gradient_checkpointing_layers) if auto else None
        return Sizing(layout, None, None, notes=[] if shape_problems else [UNKNOWN_SHAPE], cautions=cautions,
                      checkpointing=decided), problems
    problems += lay.shape_problems(layout, shape) + lay.expert_shape_problems(layout, shape)
    sft = getattr(t, "task", "sft") in OWN_TRAINER  # Liger's fused loss is SFT's: TRL's DPO scores with its own pass
    settings = Settings(stage, off_opt, off_param, t.train_type, t.lora_rank, t.lora_target_modules, bool(t.bf16 or t.fp16),
                        t.gradient_checkpointing is not False, t.max_length, spec.slurm.gpu_memory_gb, spec.slurm.ranks_per_node,
                        fused_loss=sft and t.use_liger_kernel is True, fused_loss_allowed=sft, task=getattr(t, "task", "sft"),
                        reference_copy=holds_reference_copy(getattr(t, "task", "sft"), t.train_type, t.precompute_ref_log_probs),
                        liger_layers=liger_layers(t, stage, gpus, read_disk, shape.model_type), lora_dropout=t.lora_dropout,
                        fused_lora=t.fused_lora and not compiled(t) and stage < 3, compiled=compiled(t),
                        checkpoint_layers=t.gradient_checkpointing_layers, **grpo_settings(t))
    decided = None
    if auto:
        decided = resolve_checkpointing(shape, settings, layout, gpus, t.gradient_checkpointing_layers)
        settings = replace(settings, gradient_checkpointing=decided.on, checkpoint_layers=decided.layers)
    memory = estimate(shape, settings, layout)
    advised = advice(shape, settings, layout)
    if gpus and packs and memory.fits and (merged := merge_accumulation(shape, settings, layout)):
        advised.append(merged)
    notes = list(memory.notes)
    if not settings.liger_layers and liger_wanted(t, stage, gpus, read_disk):
        notes.append(liger_unpatched_note(shape.model_type))
    return Sizing(layout, shape, memory, advised, notes, gpus, cautions, decided), problems


def merge_accumulation(shape: ModelShape, s: Settings, layout: lay.Layout) -> str | None:
    """Where ``gradient_accumulation_steps`` > 1 and a larger micro-batch fits (its estimate + the "auto" margin): the
    largest that does, with the accumulation that keeps the global batch. The same packed rows per optimizer step in
    fewer, fuller passes; the optimizer step and the loop's fixed cost are then spread over more tokens (0.5B full
    fine-tuning on an H200, docs/benchmarks.md: micro-batch 8 gave 1.26x the useful tokens/s of 4). Advice only: the
    loss is averaged over the same tokens either way, but a user may have chosen the split (memory headroom, a
    reproduced recipe), so it is never made silently."""
    factor = layout.grad_accum
    while factor > 1:
        if layout.grad_accum % factor == 0:
            wider = replace(layout, micro_batch=layout.micro_batch * factor, grad_accum=layout.grad_accum // factor)
            e = estimate(shape, s, wider)
            if e.total_bytes * (1 + AUTO_CHECKPOINTING_MARGIN) <= s.gpu_memory_gb * GIB:
                return (f"train.per_device_train_batch_size = {wider.micro_batch} with gradient_accumulation_steps = "
                        f"{wider.grad_accum}: the same {layout.micro_batch * layout.grad_accum} rows per optimizer step "
                        f"in {wider.grad_accum} pass{'es' if wider.grad_accum > 1 else ''} instead of {layout.grad_accum}, "
                        f"faster ({e.total_bytes / GIB:.1f} GiB per GPU)")
        factor -= 1
    return None


def liger_layers(t: Any, stage: int, gpus: bool, look: bool, model_type: str | None) -> bool:
    """Whether the nodes will run Liger's RMSNorm, RoPE and SwiGLU (which keep fewer activations than the model's
    own): the rules of ``train.kernels.choose.resolve_liger`` for SFT/PT on GPUs, for a model of a type Liger patches
    (``sizing.liger``; an unknown type is not counted). ``true`` takes them (a node without liger-kernel refuses to
    start); ``"auto"`` where liger-kernel is installed, which only ``look`` asks of this Python (the nodes import the
    same environment); without looking, not counted (the larger estimate)."""
    return liger_wanted(t, stage, gpus, look) and liger.patches(model_type, look)


def liger_wanted(t: Any, stage: int, gpus: bool, look: bool) -> bool:
    """``liger_layers`` before the model's type: the nodes would take Liger's layers for a model it patches."""
    if not gpus or stage >= 3 or getattr(t, "task", "sft") not in OWN_TRAINER or t.use_liger_kernel is False:
        return False
    return t.use_liger_kernel is True or (look and not compiled(t) and liger_installed())


def compiled(t: Any) -> bool:
    """The nodes compile the decoder layers: ``train.compile``, or ``train.fp8 = true`` (``train.run.compiles``; "auto"
    resolves off), which also turns Liger's "auto" off there."""
    return bool(t.compile) or getattr(t, "fp8", False) is True


def liger_unpatched_note(model_type: str | None) -> str:
    """The estimate's note where Liger is wanted but the model's type is not one Liger patches (or is unknown)."""
    if model_type is None:
        return ("Liger's layers are not counted: the model's shape names no model_type (set train.model_shape.model_type, "
                "e.g. \"qwen2\", for a hub model Liger patches)")
    return f"Liger's layers are not counted: Liger has no kernels for model type {model_type!r} and leaves such a model as it is"


LIGER_COUNTED = "; Liger's RMSNorm, RoPE and SwiGLU counted"


def liger_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("liger_kernel") is not None


# train.gradient_checkpointing = "auto": off (or on for fewer layers) only when the estimate, grown by this margin, fits
# the GPU. Measured (docs/benchmarks.md): the estimate's allocator part is over every measured max_memory_allocated, by
# +1%..+11% on an H200 (0.5B/1.5B/3B full, 8B LoRA) and +3.6%..+7.8% on an H100 80GB (8B LoRA with 0, 4, 8, 16 and 32
# layers recomputed); its total (x 1.1 fragmentation + the CUDA context) is +6%..+14% over the reserved pool plus the
# context there. But a 3B full fine-tune at 80 GB with 27 of 36 layers recomputed (chosen with 5%) reserved 77.2 GiB
# where the estimate's total said 76.2: the allocator's pool was 1.22x its peak (the activations' blocks and the
# optimizer step's do not reuse each other), not the 1.1 counted. 10% on top: the 8B LoRA recomputes 2 of 32 layers at
# 80 GB instead of all 32 (15% asked for 4), the 3B 32 of 36.
AUTO_CHECKPOINTING_MARGIN = 0.10
CPU_CHECKPOINTING = "a CPU job (slurm.gpus_per_node = 0) has no GPU memory to size against; on, as before"


@dataclass(frozen=True)
class Checkpointing:
    """``gradient_checkpointing = "auto"`` decided: on or off, how many layers recompute, and why."""

    on: bool
    why: str
    layers: int | None = None  # gradient_checkpointing_layers: with it on, the first k decoder layers recompute; None: all

    def to_json(self) -> dict[str, Any]:
        return {"on": self.on, "layers": self.layers if self.on else None, "why": self.why}


def resolve_checkpointing(shape: ModelShape, s: Settings, layout: lay.Layout, gpus: bool,
                          layers: int | None = None) -> Checkpointing:
    """``gradient_checkpointing = "auto"``. Off when the estimate without checkpointing, plus
    ``AUTO_CHECKPOINTING_MARGIN``, fits ``slurm.gpu_memory_gb``: recomputing every layer in the backward costs about a
    third of a step (8B LoRA on an H100 80GB: 10.9k useful tokens/s with it, 15.6k without), so it only pays where
    memory needs it. Else on for as few layers as fit: the smallest count of first layers (``gradient_checkpointing_layers``,
    unless the spec set it) whose estimate plus the margin fits, each layer left out of the recompute saving its share of
    that third (4, 8, 16 of 32: 14.7k, 14.0k, 12.7k); every layer where none fits (the plan's advice then says what would)."""
    if not gpus:
        return Checkpointing(True, "on (auto): " + CPU_CHECKPOINTING, layers)

    def need(on: bool, k: int | None = None) -> int:
        return int(estimate(shape, replace(s, gradient_checkpointing=on, checkpoint_layers=k), layout).total_bytes
                   * (1 + AUTO_CHECKPOINTING_MARGIN))

    room = s.gpu_memory_gb * GIB
    without = need(False)
    found = (f"estimated {without / (1 + AUTO_CHECKPOINTING_MARGIN) / GIB:.1f} GiB per GPU without it "
             f"(+{AUTO_CHECKPOINTING_MARGIN:.0%} margin = {without / GIB:.1f}{LIGER_COUNTED if s.liger_layers else ''}), "
             f"slurm.gpu_memory_gb = {s.gpu_memory_gb:g}")
    if without <= room:
        return Checkpointing(False, f"off (auto): {found}; recomputing activations would only cost speed")
    total = shape.num_layers
    for k in [layers] if layers else range(1, total):  # the fewest layers recomputed first
        with_k = need(True, k) if k < total else room + 1
        if with_k <= room:
            return Checkpointing(True, f"on for the first {k} of {total} layers (auto): {found}; with {k} recomputed "
                                 f"{with_k / (1 + AUTO_CHECKPOINTING_MARGIN) / GIB:.1f} GiB "
                                 f"(+{AUTO_CHECKPOINTING_MARGIN:.0%} = {with_k / GIB:.1f}) fits", k)
    return Checkpointing(True, f"on (auto): {found}; it does not fit without"
                         + ("" if not layers or layers >= total else f", nor with the first {layers} layers recomputed"), layers)


@dataclass(frozen=True)
class AsyncSave:
    """``checkpoint.async_save`` decided for a task: on or off, and why; ``problem`` when the spec's ``true`` cannot fit."""

    on: bool
    why: str
    problem: Problem | None = None


ASYNC_SAVE_CPU = "a CPU job (slurm.gpus_per_node = 0): its state is in host memory already, and the copy would double it"
# On an H100 the snapshot's files are a direct torch.save's bytes (benchmarks/gpu/async_bytes.py) and a 1.5B full
# fine-tune's save stalled training 0.47 s instead of 30.5 s (docs/benchmarks.md): "auto" is on for GPU jobs
ASYNC_SAVE_GPU = ("a GPU job: training stops only for the copy to pinned host memory, the write, hash and commit run "
                  "in the background")


def mem_bytes(mem: str | None) -> int | None:
    """``slurm.mem`` (sbatch syntax, megabytes without a suffix) in bytes; None when unset or 0 (all of the node's)."""
    if not mem:
        return None
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    value = int(mem[:-1]) * scale[mem[-1]] if mem[-1] in scale else int(mem) << 20
    return value or None


def resolve_async_save(setting: bool | str, gpus: bool, memory: MemoryEstimate | None, mem: str | None) -> AsyncSave:
    """``checkpoint.async_save`` (pure). "auto": on for GPU jobs whose host copy fits ``slurm.mem`` (or where it is
    unset), off otherwise, with the reason (CPU jobs: the copy doubles host memory). ``true`` where the host copy
    (the estimate's ``checkpoint_bytes_per_node``) does not fit: the problem validate reports (the nodes would run out of
    host memory at the first save)."""
    node = mem_bytes(mem)
    staged = memory.checkpoint_bytes_per_node if memory is not None else None
    too_big = node is not None and staged is not None and staged > node
    found = (f"a save stages {staged / GIB:.1f} GiB of host memory per node, slurm.mem = {mem}" if staged is not None and node
             else None)
    if setting is False:
        return AsyncSave(False, "off (checkpoint.async_save = false)")
    if setting is True:
        if too_big:
            return AsyncSave(False, "", Problem("checkpoint.async_save", "the host copy of an asynchronous save does not fit "
                                                "the node's memory", str(found), "raise slurm.mem, or set "
                                                "checkpoint.async_save = false (a synchronous save stages nothing)"))
        return AsyncSave(True, "on (checkpoint.async_save = true)")
    if not gpus:
        return AsyncSave(False, "off (auto): " + ASYNC_SAVE_CPU)
    if too_big:
        return AsyncSave(False, f"off (auto): {found}; saves are synchronous")
    return AsyncSave(True, "on (auto): " + ASYNC_SAVE_GPU + (f" ({found})" if found else ""))


def grpo_settings(t: Any) -> dict[str, Any]:
    """What GRPO adds to a step's memory (``task = "grpo"``): the reference model, a frozen copy of the weights,
    when the KL term is on and the adapter cannot stand in for it (full fine-tuning); and the KV cache of the
    sequences a rank generates at once (its micro-batch x accumulation steps, each up to max_length)."""
    if getattr(t, "task", "sft") != "grpo":
        return {}
    return {"reference_weights": t.grpo_beta > 0 and t.train_type == "full",
            "generation_sequences": t.per_device_train_batch_size * t.gradient_accumulation_steps}
