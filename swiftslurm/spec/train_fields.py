"""The ``[train]`` table by concern: one typed group of fields per concern, each field's meaning on the field.

``model.TrainTable`` is all of them at once (the TOML users write is flat: ``[train] lora_rank = 16``, read as
``spec.train.lora_rank``); the README's spec reference is generated from these descriptions (``spec/doc.py``). The
rules between fields live beside their concern: ``training_rules.py``, ``eval_rules.py``, ``grpo_rules.py``,
``reward_rules.py``, called from ``TrainTable``'s one cross-field check.
"""

from __future__ import annotations

from typing import Literal, Union

from pydantic import Field

from ..tasks import TaskName, task_help
from .parallel import ModelShapeTable, Table

AttnImplementation = Literal["auto", "sdpa", "eager", "flex_attention", "varlen_attn", "flash_attention_2", "flash_attention_3"]
ReportTarget = Literal["tensorboard", "wandb", "mlflow", "none"]
TINY_MODELS = ("tiny-llama", "tiny-moe", "tiny-vl")  # built in code (train/tinymodel.py)
MAX_COUNT = 10**9  # steps, iops, ...: beyond this a number is a typo, and C/torch integers would overflow


class ModelFields(Table):
    """What is trained, and how: the model, full or LoRA fine-tuning, the task, your own script instead."""

    model: str | None = Field(None, description=(
        'a hub id, a local directory, or `tiny-llama` / `tiny-moe` / `tiny-vl` (2-layer test models built from a '
        'config, no download; `tiny-moe`: a Qwen3-MoE of 4 experts, top-2; `tiny-vl`: a LLaVA vision-language model, '
        'its CLIP tower on 28x28 images, for `sft` and `dpo` on records with `images`)'
    ))
    train_type: Literal["lora", "full"] = Field("lora", description=(
        '`lora` or `full`'
    ))
    task: TaskName = Field("sft", description=task_help())  # the registered tasks: swiftslurm/tasks.py
    # a hub model not on disk: its shape, for `plan`'s memory estimate
    model_shape: ModelShapeTable | None = Field(None, description=(
        'a hub model not on disk: `{ hidden_size, num_layers, heads, kv_heads, intermediate_size, vocab_size,'
        " tie_word_embeddings, head_dim, model_type }` for `plan`'s memory estimate and the head checks at "
        "`validate` (a local model's config.json and `tiny-llama` need none); `model_type` (config.json's, "
        'e.g. `"qwen2"`) lets the estimate count Liger\'s layers where Liger patches that type; a mixture-of-experts '
        'model adds `experts, experts_per_token, moe_intermediate_size, shared_expert_intermediate_size, dense_layers` '
        '(each documented on its field in spec/parallel.py): `plan` then shows total and active parameters'
    ))
    router_aux_loss_coef: float | None = Field(None, ge=0, le=10, description=(
        "mixture-of-experts models: the weight of the router's load-balancing loss added to the loss (transformers'"
        " `output_router_logits`, off by default there); unset: the model config's own `router_aux_loss_coef`, "
        "0.001 where it has none; `0` turns it off. Dense models ignore it"
    ))
    command: list[str] = Field(default_factory=list, description=(
        'run your own script instead of the built-in trainer, e.g. `["python", "train.py"]`, with the same '
        'env, preflight and requeue'
    ))


class DataFields(Table):
    """The training data: the files, the sequence length, packing, tokenisation and loading."""

    dataset: list[str] = Field(default_factory=list, description=(
        'one path or a list, read in order and mixed: JSONL (`.jsonl`), JSON arrays (`.json`), `.parquet`, '
        '`.arrow`, or a `datasets` `save_to_disk` directory; records in alpaca '
        '(`instruction`/`input`/`output`) or messages (`[{role, content}]`) format'
    ))
    max_length: int = Field(2048, ge=8, le=1_048_576, description=(
        'tokens per sample; longer samples are truncated'
    ))
    packing: bool = Field(True, description=(
        'pack whole samples into rows of exactly `max_length` tokens (`per_device_train_batch_size` then '
        'counts packed rows); attention and labels never cross a sample'
    ))
    dataset_num_proc: int = Field(1, ge=1, le=256, description=(
        'processes that tokenize the dataset (once: the result is cached next to the checkpoints)'
    ))
    dataset_scan: bool = Field(True, description=(
        'validate, plan and submit read every record of the dataset and name a malformed one (file and line, '
        'or row index); false skips that scan (huge data: the trainer still checks every record when it '
        'tokenizes)'
    ))
    dataloader_num_workers: int = Field(0, ge=0, le=64, description=(
        'DataLoader worker processes per rank (0 = in the training process)'
    ))
    dataloader_pin_memory: bool = Field(True, description=(
        'pinned host memory for batches (GPU runs)'
    ))


class ScheduleFields(Table):
    """The batch, the schedule and what a run reports: micro-batch, accumulation, learning rate and steps."""

    per_device_train_batch_size: int = Field(1, ge=1, le=4096, description=(
        'micro-batch per rank'
    ))
    gradient_accumulation_steps: int = Field(1, ge=1, le=65536, description=(
        'micro-batches per optimizer step'
    ))
    learning_rate: float = Field(1e-4, gt=0, le=10, description=(
        'peak learning rate'
    ))
    lr_scheduler_type: Literal["linear", "cosine", "constant", "constant_with_warmup"] = Field("cosine", description=(
        '`linear`, `cosine`, `constant`, `constant_with_warmup`'
    ))
    warmup_ratio: float = Field(0.0, ge=0, lt=1, description=(
        'fraction of the steps spent warming up'
    ))
    weight_decay: float = Field(0.0, ge=0, le=10, description=(
        'AdamW weight decay'
    ))
    max_grad_norm: float = Field(1.0, ge=0, le=1e6, description=(
        'clip the global gradient norm to this (0 = no clipping, and then no `grad_norm` in the logs); '
        "`doctor`'s `nan_grad_norm` suggests 0.5"
    ))
    max_steps: int | None = Field(None, ge=1, le=MAX_COUNT, description=(
        'optimizer steps (or `num_train_epochs`, not both)'
    ))
    num_train_epochs: float | None = Field(None, gt=0, le=1_000_000, description=(
        'epochs when `max_steps` is unset (default 1)'
    ))
    save_steps: int = Field(100, ge=1, le=MAX_COUNT, description=(
        'a verified checkpoint every this many steps'
    ))
    logging_steps: int = Field(10, ge=1, le=MAX_COUNT, description=(
        'metrics every this many steps'
    ))
    seed: int = Field(42, ge=0, lt=2**32, description=(
        'seed for init, data order and dropout'
    ))
    report_to: list[ReportTarget] = Field(default_factory=lambda: list[ReportTarget](["tensorboard"]), description=(
        '`tensorboard`, `wandb`, `mlflow` (the `tracking` extra; one run per training across requeues: '
        'docs/training.md) and/or `none`'
    ))


class MemoryFields(Table):
    """DeepSpeed, precision and activation memory."""

    deepspeed: str = Field("zero2", description=(
        'a preset (`zero0` ... `zero2_fast`), a path to a DeepSpeed JSON, or `"none"`: plain DDP, no '
        'DeepSpeed (the path for GaLore/APOLLO)'
    ))
    bf16: bool = Field(False, description=(
        'bf16 mixed precision'
    ))
    fp16: bool = Field(False, description=(
        'fp16 mixed precision (not with bf16)'
    ))
    # plan resolves "auto" by its memory estimate
    gradient_checkpointing: Union[bool, Literal["auto"]] = Field("auto", description=(
        'recompute activations in the backward pass: `true`, `false`, or `"auto"` = off where `plan`\'s memory'
        ' estimate without it (+10%) fits `slurm.gpu_memory_gb`, else on for the fewest layers that fit (see '
        '`gradient_checkpointing_layers`); on for CPU jobs and unknown model shapes'
    ))
    gradient_checkpointing_layers: Union[int, None] = Field(None, ge=1, le=100_000, description=(
        'with gradient checkpointing on, how many decoder layers recompute their activations: the first ones; the '
        'others keep theirs, which is faster. Unset: all, or with `gradient_checkpointing = "auto"` the fewest whose '
        'memory estimate (+10%) fits'
    ))


class LoraFields(Table):
    """LoRA's adapter (train_type = "lora")."""

    lora_rank: int = Field(8, ge=1, le=4096, description=(
        'LoRA rank'
    ))
    lora_alpha: int = Field(32, ge=1, le=1_000_000, description=(
        'LoRA alpha'
    ))
    lora_dropout: float = Field(0.05, ge=0, lt=1, description=(
        'LoRA dropout'
    ))
    lora_target_modules: Union[str, list[str]] = Field("all-linear", description=(
        '`all-linear` or a list of module names'
    ))
    # LoRA projections in one autograd function (train/kernels/lora.py); false: peft's forward
    fused_lora: bool = Field(True, description=(
        'LoRA (every task): each adapted projection runs its frozen base and the adapter in one autograd '
        "function, the same function as peft's with fewer full-width passes and no per-projection copy of the"
        ' dropped-out input (train/kernels/lora.py); on GPUs the LoRA dropout mask is drawn inside the '
        "adapter's matmuls (Triton), nothing stored: the same law as peft's masks, not the same draws; not "
        "under ZeRO-3 or `compile`; `false` = peft's own forward"
    ))


class OptimizerFields(Table):
    """The optimizer: AdamW, or a low-rank projected one (GaLore, APOLLO)."""

    optimizer: Literal["adamw", "galore_adamw", "galore_adamw_8bit", "apollo_adamw"] = Field("adamw", description=(
        '`adamw`, or `galore_adamw` / `galore_adamw_8bit` / `apollo_adamw` (full FT with `deepspeed = '
        '"none"`)'
    ))
    galore_rank: int = Field(128, ge=1, le=65536, description=(
        'GaLore/APOLLO: rank of the gradient projection'
    ))
    galore_update_proj_gap: int = Field(200, ge=1, le=MAX_COUNT, description=(
        'GaLore/APOLLO: steps between projection updates'
    ))
    # None: the library default (GaLore 0.25, APOLLO 1.0)
    galore_scale: float | None = Field(None, gt=0, le=1000, description=(
        'GaLore/APOLLO: scale of the projected update (unset: the library default)'
    ))


class KernelFields(Table):
    """The kernels: attention, Liger's fused kernels, torch.compile (train/kernels/)."""

    attn_implementation: AttnImplementation = Field("auto", description=(
        '`auto` (the fastest correct kernel on the node: `flash_attention_2` where installed, else on GPUs '
        '`varlen_attn` for packed bf16/fp16 rows where the flash kernel runs (sm80+), `flex_attention` for '
        'other packed rows of 4096 tokens or more, `sdpa` otherwise; `sdpa` on the CPU), `sdpa`, `eager`, '
        "`flex_attention`, `varlen_attn` (PyTorch's own flash kernel for packed samples, no flash-attn build:"
        ' GPU sm80+, packing, bf16/fp16), `flash_attention_2`, `flash_attention_3`'
    ))
    use_liger_kernel: Union[bool, Literal["auto"]] = Field("auto", description=(
        "Liger's fused kernels: `true` = all of them, the linear cross-entropy too (a GPU, `liger-kernel`, "
        'not ZeRO-3; on an H200 it halved memory but cost 12-23% of packed tokens/s; `plan` names it when it '
        'would make a run fit), `false`, or `auto` = its RMSNorm, RoPE and SwiGLU where `liger-kernel` is '
        'installed on a GPU (not ZeRO-3, not DPO), never the fused loss'
    ))
    # regional torch.compile, one graph per decoder layer (train/kernels/compile.py)
    compile: bool = Field(False, description=(
        'regional `torch.compile`: each decoder layer compiled in place (one graph serves every layer; '
        "checkpoints unchanged; Liger's kernels off with it). Off by default: on an H200 it gave an 8B LoRA "
        '+3% (within run-to-run noise) for ~105 s more start-up on every start and requeue, and a 0.5B full '
        'fine-tune 0.87x (docs/benchmarks.md)'
    ))
    # torchao float8 linear layers (train/kernels/fp8.py); measured: docs/benchmarks.md, "FP8"
    fp8: Union[bool, Literal["auto"]] = Field("auto", description=(
        "FP8 matmuls in the model's large linear layers (torchao float8 training, Hopper or Ada GPUs, with "
        '`torch.compile` of each decoder layer): `true`, `false`, or `auto` = off until the benchmark shows a '
        'gain for the model size and task (docs/benchmarks.md, FP8). Master weights, checkpoints and exports '
        'stay bf16/fp32; under LoRA the frozen base runs in FP8 and the adapters in bf16'
    ))
    fp8_recipe: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] = Field("tensorwise", description=(
        "torchao's float8 scaling recipe: `tensorwise` (one scale per tensor, the fastest), `rowwise` (a scale "
        'per row, closer to bf16), `rowwise_with_gw_hp` (rowwise, the weight gradient in bf16)'
    ))


class VisionFields(Table):
    """Vision-language models: what trains beside the language model, and the images' resolution bounds."""

    freeze_vision: bool = Field(True, description=(
        'vision-language models: keep the vision tower frozen (no gradients, no optimizer state); `false` trains it'
    ))
    freeze_projector: bool = Field(True, description=(
        'vision-language models: keep the projector between the vision tower and the language model frozen'
    ))
    image_min_pixels: int = Field(32 * 32, ge=1, le=1 << 30, description=(
        'an image smaller than this many pixels is scaled up to it before the vision tower'
    ))
    image_max_pixels: int = Field(768 * 768, ge=1, le=1 << 30, description=(
        'an image larger than this many pixels is scaled down to it: the bound on tokens an image takes in the '
        "sequence, about pixels / 784 (Qwen2-VL; a LLaVA model takes a fixed count, 576 for LLaVA-1.5, whatever this "
        "says; `plan` shows them and the memory they imply; `validate` refuses a dataset with images when one image "
        'takes more than `max_length` tokens)'
    ))


class PreferenceFields(Table):
    """Preference tasks: DPO and KTO (rules: spec/training_rules.py)."""

    dpo_beta: float = Field(0.1, gt=0, le=1000, description=(
        "DPO and KTO: how far the policy may move from the reference model (TRL's `beta`)"
    ))
    dpo_loss_type: str = Field("sigmoid", description=(
        "DPO: one of TRL's loss types (`sigmoid`, `ipo`, `hinge`, `robust`, `apo_zero`, ...)"
    ))
    precompute_ref_log_probs: bool = Field(False, description=(
        'DPO and KTO: score the reference once before training and keep no reference model'
    ))
    max_prompt_length: int | None = Field(None, ge=1, le=1_048_576, description=(
        'DPO: keep at most this many prompt tokens (the end of the prompt); below `max_length`'
    ))
    # KTO: the weight of a desirable (label = true) example's loss
    kto_desirable_weight: float = Field(1.0, gt=0, le=1000, description=(
        "KTO: weight of the loss of desirable completions (`label = true`); raise the rarer label's weight "
        "when the counts differ (TRL's `desirable_weight`)"
    ))
    kto_undesirable_weight: float = Field(1.0, gt=0, le=1000, description=(
        "KTO: weight of the loss of undesirable completions (`label = false`; TRL's `undesirable_weight`)"
    ))


class GrpoFields(Table):
    """Online RL, task = "grpo" (rules: spec/grpo_rules.py; train/tasks/grpo.py, rewards.py)."""

    reward_funcs: list[str] = Field(default_factory=list, description=(
        'GRPO: what scores each completion, in order: built-ins `length`, `format`, `accuracy` (against the '
        '`solution` column), `file.py:function` (a file next to the spec, or a path relative to it) or '
        '`module:function` (importable on the nodes); called as `f(prompts, completions, completion_ids, '
        '**columns)` -> one float per completion. One that raises stops every rank with exit code 70, naming '
        'it and the sample'
    ))
    reward_weights: list[float] | None = Field(None, description=(
        'GRPO: one weight per `reward_funcs` entry (unset: all 1.0); the reward is their weighted sum'
    ))
    reward_length_target: int | None = Field(None, ge=1, le=1_048_576, description=(
        'GRPO, built-in `length`: the completion length in tokens that scores 1.0 (0 at none or twice as '
        'many)'
    ))
    reward_format_regex: str | None = Field(None, description=(
        'GRPO, built-in `format`: 1.0 when the completion matches this Python regular expression in full '
        '(`re.DOTALL`)'
    ))
    num_generations: int = Field(8, ge=2, le=4096, description=(
        'GRPO: completions per prompt, compared with each other; must divide micro-batch x world size x '
        'accumulation steps'
    ))
    max_completion_length: int = Field(256, ge=1, le=1_048_576, description=(
        'GRPO: tokens generated per completion at most; below `max_length`'
    ))
    temperature: float = Field(1.0, gt=0, le=100, description=(
        'GRPO: sampling temperature of the generation'
    ))
    grpo_beta: float = Field(0.0, ge=0, le=1000, description=(
        "GRPO: weight of the KL to the starting model (TRL's `beta`); 0 = no reference model, LoRA scores it "
        'with the adapter off'
    ))
    use_vllm: bool = Field(False, description=(
        "GRPO: generate with vLLM in TRL's colocate mode (GPUs, vLLM installed on the nodes; refused "
        'otherwise); false = HF `generate` with the model on each rank'
    ))


class EvalFields(Table):
    """Evaluation, the best checkpoint and early stopping (train/evaluation.py; rules: spec/eval_rules.py)."""

    eval_dataset: list[str] = Field(default_factory=list, description=(
        'files to evaluate on (formats as `dataset`): tokenized, cached and packed like the training data; '
        'not with `eval_split`'
    ))
    eval_split: float = Field(0.0, ge=0, lt=1, description=(
        "hold out this fraction of `dataset`'s records for evaluation (at least one), drawn with a fixed seed"
        ' (the same records for every run and sweep task, whatever `seed` is); `0` = no split'
    ))
    # None: save_steps
    eval_steps: int | None = Field(None, ge=1, le=MAX_COUNT, description=(
        'evaluate every this many steps, on all ranks, one `eval_loss` (unset: `save_steps`); an evaluation '
        'that beats the best so far also saves a checkpoint'
    ))
    # None: per_device_train_batch_size
    per_device_eval_batch_size: int | None = Field(None, ge=1, le=4096, description=(
        'eval micro-batch per rank (packed rows with `packing`); unset: `per_device_train_batch_size`'
    ))
    metric_for_best_model: str = Field("eval_loss", description=(
        'the logged eval metric that picks the best checkpoint (`latest_best`, kept by retention) and drives '
        'early stopping: `eval_loss`, or for DPO `eval_rewards/accuracies`, `eval_rewards/margins`, ...'
    ))
    # None: inferred from the metric's name (eval_rules.greater_is_better)
    greater_is_better: bool | None = Field(None, description=(
        'whether a higher `metric_for_best_model` is better; unset: lower for names ending in `loss` (or a '
        'time), higher otherwise'
    ))
    early_stopping_patience: int | None = Field(None, ge=1, le=MAX_COUNT, description=(
        'stop (COMPLETED, the reason in the summary and `status`) after this many evaluations in a row '
        'without a new best; the count survives a requeue; unset = never'
    ))


class ResumeFields(Table):
    """Where a run starts: another run's checkpoint (the run's own newest verified one needs no key)."""

    resume_from: str | None = Field(None, description=(
        'start this run (its own `output_dir`) from another checkpoint: a `checkpoint-N` of ours (verified '
        "first; a damaged one stops the run, exit 5), another run's output dir (its newest verified), or one "
        'we did not write (an HF Trainer + DeepSpeed `checkpoint-N`, a model dir, a peft adapter dir: '
        'imported on the fly). Restores weights, optimizer, scheduler, RNG and data position; a requeue of '
        "this run resumes from its own newest checkpoint; never this run's own output dir (or a task's, or "
        'inside them). See docs/checkpoints.md'
    ))
    resume_weights_only: bool = Field(False, description=(
        'with `resume_from`: only the weights; a fresh optimizer, schedule and data order from step 0 (always'
        ' so for a model or adapter dir)'
    ))


class HealthFields(Table):
    """What watches the ranks: the collective timeout (also the start-up limit) and straggler detection."""

    ddp_timeout: int | None = Field(None, ge=10, le=7 * 24 * 3600, description=(
        'seconds a collective may wait for the other ranks before the process group aborts '
        "(TrainingArguments' `ddp_timeout`, and `DEEPSPEED_TIMEOUT` rounded up to minutes); unset = 30 "
        'minutes. A rank still starting (imports, op builds, model load) after this long, and at least 30 '
        'minutes, is ended with its stacks and where it waited (docs/runtime.md)'
    ))
    # steps per straggler window; 0 = off (train/health/straggler.py)
    straggler_window: int = Field(50, ge=0, le=MAX_COUNT, description=(
        'every this many steps the ranks share their time outside collectives; a rank over `straggler_factor`'
        " x the others' median for 3 windows in a row is named (log, metrics, `doctor`, the ledger as slow); "
        '0 = off'
    ))
    # measured: docs/runtime.md, "Stragglers"
    straggler_factor: float = Field(2.0, gt=1, le=1000, description=(
        "how much slower than the other ranks' median a rank's window must be to count as slow "
        '(docs/runtime.md, Stragglers)'
    ))
