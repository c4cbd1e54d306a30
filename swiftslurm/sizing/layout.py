"""The parallel layout of a job: world = data x sequence x tensor parallel ranks, and every combination
DeepSpeed cannot train, as Problems (what, found, what to do). Pure.

Sources for the rules (see docs/training.md): DeepSpeed's Ulysses wrapper for HF models
(``deepspeed/runtime/sequence_parallel/ulysses_sp.py``: heads % sp == 0; kv % sp == 0 or sp % kv == 0;
no eager attention; position_ids in every batch; seqlen % sp == 0; the 4D mask is dropped, so packed rows
stay separate only with flash attention) and its AutoTP training tutorial (ZeRO stage 0, 1 or 2, full
fine-tuning; heads and kv heads split across the TP ranks).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import Problem
from .shape import ModelShape

# attention kernels that keep packed samples apart under Ulysses SP: they read sample boundaries from the
# position_ids the wrapper gathers (flash-attn's varlen path, and our ``varlen_attn`` over torch's flash kernel,
# no package needed on sm80+ GPUs), while sdpa and flex lose the block-diagonal mask the wrapper drops. All are
# CUDA kernels: a CPU rank never runs one (``auto`` resolves to sdpa there, an explicit one is refused).
SP_PACKING_ATTN = ("flash_attention_2", "flash_attention_3", "varlen_attn")


def keeps_packed_apart(attn: str) -> bool:
    """The rule the trainer applies on the node (``train.parallel``) to the attention it resolved: with sequence
    parallel and packed rows, only these kernels keep samples apart. ``validate`` applies it to what it can know."""
    return attn in SP_PACKING_ATTN


@dataclass(frozen=True)
class Layout:
    world_size: int
    sequence_parallel: int
    tensor_parallel: int
    micro_batch: int
    grad_accum: int
    expert_parallel: int = 1  # AutoEP: each MoE layer's routed experts split over this many data-parallel ranks

    @property
    def model_parallel(self) -> int:
        return self.sequence_parallel * self.tensor_parallel

    @property
    def data_parallel(self) -> int:
        """Ranks that see different samples: the world less the SP and TP groups (at least 1)."""
        return max(1, self.world_size // self.model_parallel)

    @property
    def zero_partitions(self) -> int:
        """How many ranks ZeRO shards the model states over: every rank of a TP shard, SP ranks included."""
        return max(1, self.world_size // self.tensor_parallel)

    @property
    def global_batch(self) -> int:
        """Samples (or packed rows) per optimizer step: micro-batch x accumulation x data-parallel size."""
        return self.micro_batch * self.grad_accum * self.data_parallel

    def to_json(self) -> dict[str, int]:
        return {"world_size": self.world_size, "data_parallel": self.data_parallel,
                "sequence_parallel": self.sequence_parallel, "tensor_parallel": self.tensor_parallel,
                "global_batch": self.global_batch, **({"expert_parallel": self.expert_parallel} if self.expert_parallel > 1 else {})}


def degree_problems(layout: Layout, where: str = "parallel") -> list[Problem]:
    """The world size must split into whole SP x TP groups."""
    sp, tp, world = layout.sequence_parallel, layout.tensor_parallel, layout.world_size
    if world % (sp * tp) == 0:
        return []
    return [Problem(where, f"the world size is not a multiple of sequence_parallel x tensor_parallel = {sp * tp}",
                    f"world size {world} (slurm.nodes x ranks per node), sequence_parallel {sp}, tensor_parallel {tp}",
                    f"use nodes x gpus_per_node that is a multiple of {sp * tp}, or degrees whose product divides {world}")]


def training_problems(layout: Layout, zero_stage: int, train_type: str, attn: str, packing: bool, max_length: int,
                      where: str = "parallel", gpus: bool = True) -> list[Problem]:
    """What the spec alone refuses (no model shape needed). ``gpus``: the job asks for GPUs (slurm.gpus_per_node);
    ``packing``: rows are packed (SFT with train.packing)."""
    sp, tp = layout.sequence_parallel, layout.tensor_parallel
    out: list[Problem] = []
    if sp > 1 and tp > 1:
        out.append(Problem(where, "sequence_parallel and tensor_parallel together are not supported: DeepSpeed's Ulysses "
                           "wrapper and AutoTP each build their own process groups, and no DeepSpeed release tests them together",
                           f"sequence_parallel {sp}, tensor_parallel {tp}", "use one of them (the other = 1)"))
    if tp > 1 and train_type != "full":
        out.append(Problem(f"{where}.tensor_parallel", "AutoTP trains full fine-tuning only (DeepSpeed splits the base "
                           "Linear layers; peft's LoRA layers wrap them and are not split)", f"train.train_type = {train_type!r}",
                           'set train.train_type = "full", or tensor_parallel = 1 (ZeRO shards LoRA runs well)'))
    if tp > 1 and zero_stage == 3:
        out.append(Problem(f"{where}.tensor_parallel", "AutoTP training supports ZeRO stages 0, 1 and 2 (DeepSpeed's AutoTP "
                           "tutorial; ZeRO-3 with AutoTP is unreleased work)", "ZeRO stage 3",
                           'use train.deepspeed = "zero1" or "zero2"'))
    if sp > 1:
        if attn == "eager":
            out.append(Problem(f"{where}.sequence_parallel", "Ulysses sequence parallel refuses eager attention (it needs an "
                               "O(n^2) 4D mask)", 'train.attn_implementation = "eager"', 'use "sdpa", "flash_attention_2" or "auto"'))
        elif packing and not gpus:
            out.append(Problem(f"{where}.sequence_parallel", f"sequence_parallel = {sp} with packed rows needs flash attention, "
                               "which runs on CUDA GPUs only: the Ulysses wrapper drops the mask that keeps packed samples apart, "
                               "and on this CPU job the ranks would resolve attention to sdpa (refused on the node)",
                               f"slurm.gpus_per_node = 0, train.packing = true, train.attn_implementation = \"{attn}\"",
                               "set train.packing = false for a CPU run, or ask for GPUs (slurm.gpus_per_node): on sm80+ GPUs "
                               "with bf16/fp16, attn_implementation = \"auto\" takes torch's flash kernel (varlen_attn)"))
        elif packing and attn != "auto" and not keeps_packed_apart(attn):
            out.append(Problem(f"{where}.sequence_parallel", "with sequence parallel, packed rows need flash attention: the Ulysses "
                               f"wrapper drops the mask that keeps packed samples apart, so with {attn} samples "
                               "would attend to each other", f'train.packing = true, train.attn_implementation = "{attn}"',
                               'set attn_implementation = "auto" or "varlen_attn" (sm80+ GPU, bf16/fp16), "flash_attention_2" '
                               '(flash-attn installed), or train.packing = false'))
        if max_length % sp:
            out.append(Problem("train.max_length", f"with sequence_parallel = {sp}, every sequence is split into {sp} equal "
                               "shards, so max_length must be a multiple of it", f"max_length {max_length}",
                               f"use {max_length + sp - max_length % sp} or {max_length - max_length % sp or sp}"))
    return out


def shape_problems(layout: Layout, shape: ModelShape, where: str = "parallel") -> list[Problem]:
    """What the model's heads allow (a local config.json at validate, or the model on the nodes)."""
    sp, tp = layout.sequence_parallel, layout.tensor_parallel
    heads, kv = shape.num_heads, shape.num_kv_heads
    found = f"{heads} attention heads, {kv} KV heads ({shape.source or 'the model'})"
    out: list[Problem] = []
    if sp > 1:
        if heads % sp:
            out.append(Problem(f"{where}.sequence_parallel", f"Ulysses gives each of the {sp} ranks a whole number of attention "
                               "heads: the head count must divide by sequence_parallel", found,
                               f"use a sequence_parallel that divides {heads}: {_divisors(heads)}"))
        elif kv % sp and sp % kv:
            out.append(Problem(f"{where}.sequence_parallel", "Ulysses needs the KV heads to divide by sequence_parallel, or "
                               "sequence_parallel to divide by the KV heads (they are then replicated)", found,
                               f"use a sequence_parallel among {_divisors(heads)} that divides {kv} or is a multiple of it"))
    if tp > 1:
        if heads % tp or kv % tp:
            out.append(Problem(f"{where}.tensor_parallel", "AutoTP splits the attention heads and KV heads across the "
                               "tensor-parallel ranks: both must divide by tensor_parallel", found,
                               f"use a tensor_parallel that divides {kv}: {_divisors(kv)}"))
        if shape.intermediate_size % tp:
            out.append(Problem(f"{where}.tensor_parallel", "AutoTP splits the MLP's intermediate size across the "
                               "tensor-parallel ranks: it must divide by tensor_parallel",
                               f"intermediate_size {shape.intermediate_size}", f"a tensor_parallel that divides {shape.intermediate_size}"))
    return out


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0 and d <= 64)


# config.json's model_type -> DeepSpeed 0.19.8's AutoEP preset for it (module_inject/auto_ep_presets/*.py,
# ``hf_model_types``; DeepSpeed picks the preset from the loaded model's type). OLMoE has none.
AUTOEP_PRESETS: dict[str, str] = {
    "mixtral": "mixtral", "qwen3_moe": "qwen3_moe", "qwen2_moe": "qwen3_moe", "qwen3_5_moe": "qwen3_5_moe",
    "qwen3_5_moe_text": "qwen3_5_moe", "deepseek_v2": "deepseek_v2", "deepseek_v3": "deepseek_v3",
}
EP_CPU = "AutoEP is not run on CPU ranks here"


def expert_problems(layout: Layout, zero_stage: int, gpus: bool, where: str = "parallel.expert") -> list[Problem]:
    """What ``[parallel] expert`` refuses before the model's shape is known (sources: DeepSpeed 0.19.8's
    ``module_inject/auto_ep_config.py`` and ``auto_ep_folding.py``)."""
    ep, sp, tp = layout.expert_parallel, layout.sequence_parallel, layout.tensor_parallel
    if ep == 1:
        return []
    found = f"expert = {ep}"
    out: list[Problem] = []
    if not gpus:
        out.append(Problem(where, f"{EP_CPU}: DeepSpeed's AutoEP exchanges tokens between the expert ranks with all-to-all "
                           "over NCCL, and this project has not run it on gloo", f"{found}, slurm.gpus_per_node = 0",
                           "ask for GPUs (slurm.gpus_per_node), or set expert = 1 for a CPU run"))
    if zero_stage == 3:
        out.append(Problem(where, "AutoEP with ZeRO-3 partitions the experts under limits DeepSpeed lists separately; "
                           "only ZeRO stages 0, 1 and 2 are allowed with expert parallel here", f"{found}, ZeRO stage 3",
                           'use train.deepspeed = "zero1" or "zero2" (expert parallel already splits the experts\' weights)'))
    if sp > 1 or tp > 1:
        out.append(Problem(where, "expert parallel beside sequence or tensor parallel is refused: DeepSpeed 0.19.8 folds AutoEP "
                           "with AutoTP (no offload, no Ulysses) but this trainer has not run either combination",
                           f"{found}, sequence_parallel {sp}, tensor_parallel {tp}", "set sequence_parallel and tensor_parallel to 1"))
    elif layout.data_parallel % ep:
        out.append(Problem(where, "AutoEP splits the experts over groups of data-parallel ranks: the data-parallel size must "
                           "divide by expert", f"{found}, data-parallel size {layout.data_parallel}",
                           f"use an expert degree that divides {layout.data_parallel}: {_divisors(layout.data_parallel)}"))
    return out


def expert_shape_problems(layout: Layout, shape: ModelShape, where: str = "parallel.expert") -> list[Problem]:
    """What ``[parallel] expert`` needs of the model: experts (an MoE model), a type AutoEP has a preset for, and an
    expert count each expert rank takes an equal share of."""
    ep = layout.expert_parallel
    if ep == 1:
        return []
    name = shape.source or "the model"
    if not shape.moe_layers:
        return [Problem(where, "expert parallel splits a mixture-of-experts model's experts; this model has none",
                        f"expert = {ep}, a dense model ({name})", "set expert = 1, or train an MoE model (set "
                        "train.model_shape.experts and experts_per_token for a hub model not on disk)")]
    out: list[Problem] = []
    if shape.model_type not in AUTOEP_PRESETS:
        out.append(Problem(where, "DeepSpeed's AutoEP has no preset for this model type (it knows "
                           f"{', '.join(sorted(set(AUTOEP_PRESETS.values())))})",
                           f"model_type {shape.model_type!r} ({name})",
                           "set expert = 1 (ZeRO still shards the experts' optimizer states)" if shape.model_type else
                           "set train.model_shape.model_type to the model's config.json model_type (e.g. \"qwen3_moe\")"))
    if shape.num_experts % ep:
        out.append(Problem(where, "each expert rank holds an equal share of every MoE layer's experts: the expert count "
                           "must divide by expert", f"{shape.num_experts} experts ({name}), expert = {ep}",
                           f"use an expert degree that divides {shape.num_experts}: {_divisors(shape.num_experts)}"))
    return out
