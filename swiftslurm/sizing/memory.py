"""Per-rank GPU memory of a training step, estimated before launch (pure). ``plan`` prints it.

model states   DeepSpeed's own formulas (``estimate_zero2_model_states_mem_needs``,
               ``estimate_zero3_model_states_mem_needs``; mixed precision: 2 bytes of 16-bit weights plus
               18 bytes per trainable parameter = 16-bit grads 2 + fp32 grads 4 + fp32 master weights 4 + Adam
               moments 8), over the ZeRO partitions (world / tensor_parallel), stage 0 and 1 by the same
               accounting. fp32 training: 4 bytes of weights + 12 per trainable parameter (grads 4, moments 8).
               LoRA: frozen weights keep only their weights; grads and optimizer states are the adapter's.
               Tensor parallel divides the decoder layers' parameters (not the embeddings).
activations    tokens per rank = micro-batch x max_length / sequence_parallel. With gradient checkpointing a
               recomputed layer keeps its input (hidden x tokens) and one layer at a time holds its full
               activations again; a layer that is not recomputed (without checkpointing, or between the
               layers after the ``gradient_checkpointing_layers`` first) holds them from forward to backward.
               What a layer keeps depends on its kernels: Liger's RMSNorm and SwiGLU keep fewer tensors
               than transformers' eager ones (``liger_layers``), and peft's LoRA forward keeps a dropped-out
               copy of each adapted projection's input (``_lora_dropout_bytes``). Plus the logits and the
               loss's fp32 copies (vocab x tokens).
peak           the forward and backward hold the activations beside the weights, the optimizer's states and the
               16-bit gradients; the optimizer step's fp32 gradients (mixed precision) are made after the backward
               has freed the activations, so the peak counts the larger of the two, not their sum.
overhead       the CUDA context and kernels (outside torch's allocator), NCCL's buffers when there are
               several ranks, and the caching allocator's fragmentation (a fraction of what is allocated).
experts        a mixture-of-experts model's weights, gradients and optimizer states count every expert (total
               parameters; with ``[parallel] expert`` a rank holds 1/expert of them, and ZeRO shards their states over
               the ranks that hold the same experts, so the sharded states come to the whole model's over the
               partitions either way); its activations count what a token runs through (the top-k experts, the
               router's logits and probabilities, the routed copies of its hidden state; frozen experts, as under
               LoRA on the attention, keep less than trained ones: ``RoutedTerms``), and ``moe_dispatch`` one
               layer's routing buffers (the permuted tokens; with expert parallel, the all-to-all's send and receive).

``allocated_bytes`` is what ``torch.cuda.max_memory_allocated`` measures; ``total_bytes`` adds the overhead
(what ``nvidia-smi`` shows). The coefficients are named below; benchmarks/gpu/memory_estimate.py compares
them with a measured peak.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import liger
from .layout import Layout
from .shape import ModelShape, lora_projections, target_names
from .tasks import extra_trainable, head_params_delta, logits_per_token, sequences_per_sample

GIB = 1 << 30
FUSED_DROPOUT_MAX_RANK = 128  # train/kernels/lora_dropout.py MAX_RANK: the widest adapter its kernels take
ZERO_BUFFER_FACTOR = 1.5  # DeepSpeed's additional_buffer_factor for the CPU side
# full activations of one layer, in elements per token, with transformers' eager kernels: hidden-sized tensors that
# tensor parallel splits (ACT_HIDDEN_TERMS: each RMSNorm keeps an fp32 copy of its input and its normalised output
# beside its scaled output; q, the attention output, o_proj's input) and the residual stream's two that it does not
# (RESIDUAL_TERMS), k and v (2 x kv width), the MLP's gate, up, act and product (4 x intermediate). Flash/sdpa/flex
# keep no seq x seq matrix.
ACT_HIDDEN_TERMS = 10
RESIDUAL_TERMS = 2
ACT_INTERMEDIATE_TERMS = 4
# with Liger's RMSNorm, RoPE and SwiGLU (use_liger_kernel): a norm keeps its input and output, SwiGLU its gate and up
# (the product is kept by down_proj): 8 x hidden in all, 3 x intermediate. Measured on one H200 (docs/benchmarks.md,
# "Fifth run: the memory estimate against every measured peak"): the 8B LoRA step at 8,192 tokens held 155.6 KB per
# token and layer, which these terms give; Liger saved 6.50 GiB on the 1.5B full step, these terms say 6.45.
ACT_HIDDEN_TERMS_LIGER = 6
ACT_INTERMEDIATE_TERMS_LIGER = 3
# beside the model-dtype logits, the loss's fp32 work: at the backward's start the fp32 log-probs, their gradient and
# the logits' fp32 gradient (4 + 4 + 4 bytes per logit; the forward holds less: an fp32 copy and the log-probs). The
# 0.5B shape, whose peak is the loss (vocabulary 151,936 on hidden 896), measured 94.1 GiB at 32,768 tokens where 8
# extra bytes gave 86.0 (-9%); 10 give 95.3 (+1%)
LOGIT_BYTES_EXTRA = 10
# compiled decoder layers (train.compile; train.fp8 = true compiles them): inductor fuses each RMSNorm and the SwiGLU
# into kernels that keep about what Liger's do, so their terms count. Measured on one H100 (docs/benchmarks.md, "FP8 on
# the 8B LoRA"): the FP8 arm, compiled and without Liger, 12 of 32 layers recomputed, peaked at 61.9 GiB where these
# terms give 65.4 (the eager terms: 75.2)
COMPILED_NOTE = ("activations counted for compiled layers (train.compile, or train.fp8 = true): inductor fuses the norms "
                 "and SwiGLU as Liger's kernels do and keeps about what they keep")
CUDA_CONTEXT_BYTES = int(1.0 * GIB)  # CUDA context + cuBLAS/cuDNN workspaces: not in max_memory_allocated
NCCL_BYTES = int(0.5 * GIB)  # NCCL's communicator buffers when world > 1
FRAGMENTATION = 0.10  # the caching allocator's reserved-but-unused share
ROUTER_BYTES_PER_EXPERT = 8  # per token and expert: the router's logits and its softmax, both fp32 in transformers
# experts LoRA adapts as weights (peft's target_parameters: "all-linear", or a list naming an expert projection)
EXPERT_TARGETS = ("gate_up_proj", "gate_proj", "up_proj", "down_proj", "experts", "w1", "w2", "w3")


@dataclass(frozen=True)
class RoutedTerms:
    """What an MoE layer keeps for the backward per routed copy of a token (experts_per_token of them), in elements:
    ``hidden`` x hidden_size, ``intermediate`` x the expert's width."""

    hidden: int
    intermediate: int


# Counted with autograd's saved tensors over transformers' grouped-GEMM experts (benchmarks/gpu/moe_saved.py; on the
# CPU, fp32, hidden 256, 64 experts of 128/256, top-4/8: the slopes are these to 2%). Trained experts (full
# fine-tuning, or LoRA on their weights) keep the copy's input row and output row and the expert's gate, up, act and
# product; frozen experts keep what the input's gradient needs: gate and up (one tensor), act, and the output row
# (the routing weight's gradient), not the input row nor the product that only weight gradients read.
ROUTED_TRAINED = RoutedTerms(hidden=2, intermediate=4)
ROUTED_FROZEN = RoutedTerms(hidden=1, intermediate=3)
# Liger's fused experts (``LigerExperts``, where its SwiGLU patch replaces the model's experts: liger.FUSED_EXPERT_TYPES)
# keep each copy's gate/up output and nothing else per copy (the layer's input row is the norm's output, already
# counted), trained or frozen: ``LigerFusedMoEFunction`` saves x, the weights, the pre-activation and the routing's
# int32 indices (14 bytes a copy, left out).
ROUTED_LIGER = RoutedTerms(hidden=0, intermediate=2)


def routed_terms(model_type: str | None, liger_layers: bool, trained: bool) -> RoutedTerms:
    """What an MoE layer keeps per routed copy: Liger's fused experts where they replace the model's, else transformers'
    experts, trained (``experts_trained``) or frozen."""
    if liger_layers and model_type in liger.FUSED_EXPERT_TYPES:
        return ROUTED_LIGER
    return ROUTED_TRAINED if trained else ROUTED_FROZEN


def experts_trained(s: Settings) -> bool:
    """Whether the routed experts' weights get gradients: full fine-tuning, or LoRA whose targets adapt them
    (``EXPERT_TARGETS``; "all-linear" does where peft knows the layout, counted so: the larger estimate)."""
    if s.train_type != "lora":
        return True
    listed = target_names(s.lora_targets)
    return listed is None or any(t.split(".")[-1] in EXPERT_TARGETS for t in listed)


def zero2_model_states(total_params: int, num_gpus_per_node: int = 1, num_nodes: int = 1, cpu_offload: bool = True,
                       additional_buffer_factor: float = ZERO_BUFFER_FACTOR) -> tuple[int, int]:
    """(cpu bytes, gpu bytes): DeepSpeed's ``estimate_zero2_model_states_mem_needs``, the same arithmetic."""
    total_gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu = 2 * total_params
        cpu = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
    else:
        gpu = 2 * total_params + int(18 * total_params / total_gpus)
        cpu = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu), int(gpu)


def zero3_model_states(total_params: int, largest_layer_params: int, num_gpus_per_node: int = 1, num_nodes: int = 1,
                       cpu_offload: bool = True, cpu_offload_params: bool = True, zero_init: bool = True,
                       additional_buffer_factor: float = ZERO_BUFFER_FACTOR) -> tuple[int, int, int]:
    """(cpu bytes, gpu bytes, largest layer bytes): DeepSpeed's ``estimate_zero3_model_states_mem_needs``."""
    total_gpus = num_nodes * num_gpus_per_node
    per_node = 1 / num_nodes
    largest = 4 * largest_layer_params
    if cpu_offload and cpu_offload_params:
        gpu = largest
        cpu = total_params * (18 * per_node if zero_init else max(4 * num_gpus_per_node, 18 * per_node)) * additional_buffer_factor
    elif cpu_offload:
        gpu = largest + int(2 * total_params / total_gpus)
        cpu = total_params * (16 * per_node if zero_init else max(4 * num_gpus_per_node, 16 * per_node)) * additional_buffer_factor
    else:
        gpu = largest + int(18 * total_params / total_gpus)
        cpu = (largest_layer_params if zero_init else total_params) * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu), int(gpu), largest


@dataclass(frozen=True)
class Settings:
    """The spec's choices that move memory (plain values, so this module needs no spec)."""

    zero_stage: int
    offload_optimizer: bool
    offload_param: bool
    train_type: str  # "full" | "lora"
    lora_rank: int
    lora_targets: Any  # str | list[str]
    half_precision: bool  # bf16 or fp16
    gradient_checkpointing: bool
    max_length: int
    gpu_memory_gb: float
    ranks_per_node: int
    fused_loss: bool = False  # train.use_liger_kernel = true: Liger's fused linear cross-entropy, no logits tensor
    fused_loss_allowed: bool = True  # whether advice may name it (SFT; TRL's DPO scores with its own pass)
    task: str = "sft"  # rm: a score head, pairs; kto: the reference copy (tasks.py)
    reference_copy: bool = False  # a frozen copy of the starting weights (KTO full fine-tuning: tasks.py)
    reference_weights: bool = False  # GRPO with a KL term, full fine-tuning: a frozen copy of the model's weights
    generation_sequences: int = 0  # GRPO: sequences one rank generates at once (their KV cache at max_length)
    liger_layers: bool = False  # Liger's RMSNorm/RoPE/SwiGLU replace the model's (use_liger_kernel true, or "auto" with it installed)
    lora_dropout: float = 0.0  # train.lora_dropout (LoRA): what its forward keeps depends on fused_lora
    fused_lora: bool = True  # train.fused_lora in effect (not under ZeRO-3 or compile): the mask drawn in the kernel
    checkpoint_layers: int | None = None  # train.gradient_checkpointing_layers: with checkpointing, the first k recompute (None: all)
    compiled: bool = False  # the decoder layers compiled (train.compile, or train.fp8 = true): see COMPILED_NOTE


@dataclass(frozen=True)
class MemoryEstimate:
    parts: dict[str, int]  # bytes per rank: weights, gradients+optimizer, activations, logits, overhead
    allocated_bytes: int  # what torch's allocator peaks at (max_memory_allocated)
    total_bytes: int  # allocated + fragmentation + CUDA context + NCCL
    cpu_bytes_per_node: int  # host memory for offloaded states (DeepSpeed's formula), 0 without offload
    gpu_memory_bytes: int
    trainable_params: int
    total_params: int
    notes: tuple[str, ...] = ()
    checkpoint_bytes_per_node: int = 0  # what a save writes from one node: the host copy an asynchronous save stages

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.gpu_memory_bytes

    def to_json(self) -> dict[str, Any]:
        gb = lambda b: round(b / GIB, 2)  # noqa: E731
        return {"per_rank_gib": {k: gb(v) for k, v in self.parts.items()}, "allocated_gib": gb(self.allocated_bytes),
                "total_gib": gb(self.total_bytes), "gpu_memory_gib": gb(self.gpu_memory_bytes), "fits": self.fits,
                "cpu_per_node_gib": gb(self.cpu_bytes_per_node), "total_params": self.total_params,
                "trainable_params": self.trainable_params, "checkpoint_per_node_gib": gb(self.checkpoint_bytes_per_node),
                "notes": list(self.notes)}


def _model_states(shape: ModelShape, s: Settings, layout: Layout, trainable: int) -> tuple[int, int, int, int]:
    """(weights bytes, grads + optimizer bytes, the part of those made only in the optimizer step, cpu bytes per
    node) on one rank. The step's part: mixed precision's fp32 gradients (4 bytes per trainable parameter, sharded as
    the optimizer is), made from the 16-bit ones once the backward is over."""
    tp, n = layout.tensor_parallel, layout.zero_partitions
    # expert parallel: the routed experts the other ranks of this rank's expert group hold (0 without it)
    elsewhere = shape.routed_expert_params - shape.routed_expert_params // layout.expert_parallel
    total = (shape.decoder_params - elsewhere) // tp + shape.embedding_params + shape.hidden_size + head_params_delta(shape, s.task)
    if s.train_type == "full":
        trainable = total
    whole = trainable + (elsewhere if s.train_type == "full" else 0)  # what ZeRO's n partitions divide between them
    frozen = total - trainable
    w_bytes = 2 if s.half_precision else 4
    # per trainable parameter, beyond its weights: mixed precision 18 (DeepSpeed's multiplier), fp32 12 (grads, moments)
    state_bytes = 18 if s.half_precision else 12
    step_bytes = 4 if s.half_precision else 0  # fp32 training accumulates its gradients in fp32 through the backward
    nodes = max(1, layout.world_size // max(1, s.ranks_per_node))
    if s.zero_stage == 3:
        # DeepSpeed: 4 x the largest layer (gathered, and the next one prefetched) + 18 bytes/param over the ranks,
        # its 18 holding the 16-bit weight shard too; fp32: 4 + 12 = 16
        weights = 2 * w_bytes * shape.largest_layer_params + (0 if s.offload_param else w_bytes * frozen // n)
        sharded = 18 if s.half_precision else 16
        if not s.offload_optimizer:
            states, step = sharded * whole // n, step_bytes * whole // n
        else:
            states, step = (0 if s.offload_param else w_bytes * trainable // n), 0
        cpu = zero3_model_states(trainable, shape.largest_layer_params, s.ranks_per_node, nodes, True, s.offload_param)[0] \
            if s.offload_optimizer else 0
        return weights, states, step, cpu
    weights = w_bytes * total
    if s.offload_optimizer:  # ZeRO-Offload: grads and optimizer states live on the CPU
        return weights, 0, 0, zero2_model_states(trainable, s.ranks_per_node, nodes, True)[0]
    if s.zero_stage == 2:
        states = state_bytes * whole // n
    elif s.zero_stage == 1:  # model-dtype gradients whole on every rank, the rest sharded
        states = w_bytes * trainable + (state_bytes - w_bytes) * whole // n
    else:
        states = state_bytes * trainable
    return weights, states, step_bytes * whole // n if s.zero_stage else step_bytes * trainable, 0


def layer_bytes(shape: ModelShape, s: Settings, tokens: int, tp: int = 1) -> tuple[int, int]:
    """(a dense layer's, an MoE layer's) activation bytes kept for the backward over ``tokens`` tokens on one rank of
    ``tp`` tensor-parallel ones, with no recomputation. benchmarks/gpu/moe_saved.py measures the MoE layer's."""
    b, h = 2 if s.half_precision else 4, shape.hidden_size
    kv_width = shape.num_kv_heads * shape.dim_per_head
    hidden_terms, inter_terms = (ACT_HIDDEN_TERMS_LIGER, ACT_INTERMEDIATE_TERMS_LIGER) if s.liger_layers or s.compiled else \
        (ACT_HIDDEN_TERMS, ACT_INTERMEDIATE_TERMS)
    attention = (hidden_terms * h + 2 * kv_width) // tp + RESIDUAL_TERMS * h
    dropout = tokens * _lora_dropout_bytes(shape, s) // tp
    dense_layer = b * tokens * (attention + inter_terms * shape.intermediate_size // tp) + dropout
    # an MoE layer: the top-k experts and the shared one a token runs through, its routed copies, the router's scores
    k, routed = shape.experts_per_token, routed_terms(shape.model_type, s.liger_layers, experts_trained(s))
    moe_layer = b * tokens * (attention + (routed.intermediate * k * shape.expert_width
                                           + inter_terms * shape.shared_expert_intermediate_size) // tp
                              + routed.hidden * k * h) + tokens * ROUTER_BYTES_PER_EXPERT * shape.num_experts + dropout
    return dense_layer, moe_layer


def _activations(shape: ModelShape, s: Settings, layout: Layout) -> tuple[int, int]:
    """(activation bytes, logits/loss bytes) on one rank at the peak of a step."""
    tokens = layout.micro_batch * sequences_per_sample(s.task) * s.max_length // layout.sequence_parallel
    b, h = 2 if s.half_precision else 4, shape.hidden_size
    dense_layer, moe_layer = layer_bytes(shape, s, tokens, layout.tensor_parallel)
    layers, moe = shape.num_layers, shape.moe_layers
    all_layers = (layers - moe) * dense_layer + moe * moe_layer
    one_layer = moe_layer if moe else dense_layer  # the largest, held again one at a time in the backward
    recomputed = min(layers, s.checkpoint_layers or layers) if s.gradient_checkpointing else 0
    # a recomputed layer keeps its input (and one at a time holds its full activations again in the backward); the
    # others keep their full activations from the forward to their backward (an MoE model's dense layers: their share)
    acts = b * tokens * h * recomputed + (one_layer if recomputed else 0) + all_layers * (layers - recomputed) // layers
    if s.fused_loss:
        logits = _fused_loss_bytes(shape, s, tokens, b)
    else:
        logits = tokens * logits_per_token(shape, s.task) * (b + LOGIT_BYTES_EXTRA)
    return acts, logits


MOE_LORA_NOTE = ("mixture-of-experts model: LoRA counted on the attention projections and the dense layers' and shared "
                 "experts' MLP projections; the routers and the fused expert weights (peft's target_parameters) are not "
                 "counted, and frozen experts keep only their weights")


def _moe_dispatch(shape: ModelShape, s: Settings, layout: Layout) -> int:
    """One MoE layer's routing buffers at a time (0 for a dense model): the tokens permuted into expert order, one row
    per routed copy; with expert parallel the all-to-all's send and receive buffers (two)."""
    if not shape.moe_layers:
        return 0
    tokens = layout.micro_batch * sequences_per_sample(s.task) * s.max_length // layout.sequence_parallel
    copies = 2 if layout.expert_parallel > 1 else 1
    return copies * (2 if s.half_precision else 4) * tokens * shape.experts_per_token * shape.hidden_size


def _lora_dropout_bytes(shape: ModelShape, s: Settings) -> int:
    """Bytes per token and layer that LoRA dropout keeps for the backward, over the adapted projections' inputs.
    peft's forward keeps each projection's dropped-out copy of its input (q, k and v one each); measured on an H200
    (8B LoRA r16, p = 0.05): 17.8 GiB over the fused path's peak at 8,192 tokens, ~1.9 bytes per element in bf16.
    The fused projection (``train.fused_lora``) draws the mask inside its Triton kernels on GPUs (bf16/fp16, rank up
    to 128: nothing kept) and keeps torch's boolean mask elsewhere (1 byte per element)."""
    if s.train_type != "lora" or s.lora_dropout <= 0:
        return 0
    dims = shape.linear_dims()
    names, _ = lora_projections(s.lora_targets)
    per_element = (1 if not s.half_precision or s.lora_rank > FUSED_DROPOUT_MAX_RANK else 0) if s.fused_lora else \
        (2 if s.half_precision else 4)
    return per_element * sum(dims[n][0] for n in names)


def _fused_loss_bytes(shape: ModelShape, s: Settings, tokens: int, b: int) -> int:
    """Liger's fused linear cross-entropy: the logits of one chunk of tokens at a time (its chunk is the next power
    of two of tokens / ceil(vocab / hidden), so a chunk's logits are about the size of the hidden states), the
    gradient of the hidden states, and an fp32 gradient of the LM head when it trains (full fine-tuning).
    Measured on an H200 (0.5B shape, 32K tokens, ZeRO-2): 63.7 GiB peak without it, 10.6 GiB with it."""
    h, vocab = shape.hidden_size, shape.vocab_size
    per_chunk = -(-tokens // -(-vocab // h))
    chunk = 1 << max(0, (per_chunk - 1).bit_length())
    head_grad = 4 * vocab * h if s.train_type == "full" else 0
    return chunk * vocab * b + tokens * h * b + head_grad


def _rl_parts(shape: ModelShape, s: Settings, layout: Layout) -> dict[str, int]:
    """GRPO's additions (none for other tasks): the reference model's 16/32-bit weights (ZeRO-3: sharded as the
    policy's are), and the KV cache of generation: keys and values of every layer for each generated sequence."""
    b = 2 if s.half_precision else 4
    out: dict[str, int] = {}
    if s.reference_weights:
        total = shape.decoder_params // layout.tensor_parallel + shape.embedding_params
        out["reference_model"] = b * total // (layout.zero_partitions if s.zero_stage == 3 else 1)
    if s.generation_sequences:
        kv_width = shape.num_kv_heads * shape.dim_per_head
        out["generation_kv_cache"] = 2 * b * shape.num_layers * kv_width * s.generation_sequences * s.max_length
    return out


def estimate(shape: ModelShape, s: Settings, layout: Layout) -> MemoryEstimate:
    total = shape.total_params + head_params_delta(shape, s.task)
    notes: list[str] = []
    if s.train_type == "full":
        trainable = total
    else:
        trainable, exact = shape.lora_params(s.lora_rank, s.lora_targets)
        trainable += extra_trainable(shape, s.task, s.train_type)
        if shape.is_moe:
            notes.append(MOE_LORA_NOTE)
        elif not exact:
            notes.append("lora_target_modules names no standard projection: LoRA counted on every linear layer (an upper bound)")
    if s.liger_layers:
        fused = shape.is_moe and shape.model_type in liger.FUSED_EXPERT_TYPES
        notes.append("activations counted with Liger's RMSNorm, RoPE and SwiGLU" + (" and its fused experts" if fused else "")
                     + " (use_liger_kernel = true, or \"auto\" where liger-kernel is installed), which keep fewer tensors "
                     "than the model's own")
    elif s.compiled:
        notes.append(COMPILED_NOTE)
    weights, states, step, cpu = _model_states(shape, s, layout, trainable)
    acts, logits = _activations(shape, s, layout)
    dispatch = _moe_dispatch(shape, s, layout)
    # a frozen reference copy (KTO full fine-tuning): the model's dtype, sharded like the policy under ZeRO-3
    ref = (2 if s.half_precision else 4) * total // (layout.zero_partitions if s.zero_stage == 3 else 1) if s.reference_copy else 0
    rl = _rl_parts(shape, s, layout)
    # the step's fp32 gradients take memory the backward has freed (activations, logits): the peak is the larger
    reuse = min(step, acts + logits)
    allocated = weights + ref + states + acts + logits + dispatch + sum(rl.values()) - reuse
    frag = int(FRAGMENTATION * allocated)
    overhead = frag + CUDA_CONTEXT_BYTES + (NCCL_BYTES if layout.world_size > 1 else 0)
    parts = {"weights": weights, **({"reference": ref} if ref else {}), "gradients_optimizer": states, "activations": acts,
             "logits_loss": logits, **({"moe_dispatch": dispatch} if dispatch else {}), **rl,
             **({"step_reuses_activations": -reuse} if reuse else {}), "overhead": overhead}
    return MemoryEstimate(parts, allocated, allocated + overhead, cpu, int(s.gpu_memory_gb * GIB), trainable, total, tuple(notes),
                          checkpoint_bytes_per_node(s, layout, trainable, total))


def checkpoint_bytes_per_node(s: Settings, layout: Layout, trainable: int, total: int) -> int:
    """The bytes one node's ranks write in a save (pure): each rank its shard of the optimizer's states (mixed precision:
    the fp32 master weights and two moments, 12 bytes per trainable parameter; fp32: the two moments), sharded over the
    ZeRO partitions, and rank 0 the model's weights (a LoRA run: the adapter's); under ZeRO-3 each rank its partition
    of them."""
    per_param = 12 if s.half_precision else 8
    states = per_param * trainable // (layout.zero_partitions if s.zero_stage else 1)
    weights = (2 if s.half_precision else 4) * (trainable if s.train_type == "lora" else total)
    if s.zero_stage == 3:  # each rank its partition of the weights (the gathered 16-bit copy is the Trainer's own write)
        return max(1, s.ranks_per_node) * (states + weights // layout.zero_partitions)
    return max(1, s.ranks_per_node) * states + weights


# ZeRO settings from the fastest to the most frugal: (label, stage, offload optimizer, offload params)
ZERO_LADDER = (("ZeRO-2 without offload", 2, False, False), ("ZeRO-3 without offload", 3, False, False),
               ("ZeRO-2 with optimizer offload", 2, True, False), ("ZeRO-3 with optimizer and parameter offload", 3, True, True))


def advice(shape: ModelShape, s: Settings, layout: Layout) -> list[str]:
    """What to change, each with its estimate: when the estimate does not fit, the settings that would (the
    fastest first); when it fits with ZeRO-3 or an offload, a faster ZeRO setting that fits too. Else nothing."""
    from dataclasses import replace

    now = estimate(shape, s, layout)
    rung = lambda st: (st.zero_stage >= 3) + 2 * st.offload_optimizer + st.offload_param  # noqa: E731  (0 = fastest)
    options = [(label, replace(s, zero_stage=stage, offload_optimizer=o, offload_param=p)) for label, stage, o, p in ZERO_LADDER]
    if s.fused_loss_allowed and not s.fused_loss and s.zero_stage < 3:  # stage 3 refuses Liger; its rungs run without it
        options.insert(0, ("train.use_liger_kernel = true", replace(s, fused_loss=True)))
    if not s.gradient_checkpointing:
        options.insert(0, ("train.gradient_checkpointing = true", replace(s, gradient_checkpointing=True)))
    options = [(label, replace(o, fused_loss=False) if o.zero_stage >= 3 else o) for label, o in options
               if o.zero_stage < 3 or layout.expert_parallel == 1]  # expert parallel refuses ZeRO-3 (sizing.layout)
    out: list[str] = []
    for label, option in options:
        if option == s or (now.fits and rung(option) >= rung(s)):
            continue
        e = estimate(shape, option, layout)
        if e.fits:
            out.append(f"{label} ({e.total_bytes / GIB:.1f} GiB per GPU)")
            if now.fits:
                break
    if not now.fits and layout.tensor_parallel == 1 and layout.expert_parallel == 1:  # long sequences: split them (the smallest SP degree that fits)
        from dataclasses import replace as dc_replace

        from .layout import shape_problems

        sp = layout.sequence_parallel * 2
        while sp <= layout.world_size and layout.world_size % sp == 0:
            wider = dc_replace(layout, sequence_parallel=sp)
            if s.max_length % sp == 0 and not shape_problems(wider, shape):
                e = estimate(shape, s, wider)
                if e.fits:
                    out.append(f"parallel.sequence_parallel = {sp} ({e.total_bytes / GIB:.1f} GiB per GPU)")
                    break
            sp *= 2
    return out
