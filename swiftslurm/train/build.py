"""What every task builds before training: the model and tokenizer, LoRA, and the TrainingArguments.

Shared by ``sft`` (and its task seam) and ``dpo``: the arguments of every task start from
``training_kwargs`` (batch, schedule, saving, precision, DeepSpeed or plain DDP, the optimizer).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from ..errors import SwiftSlurmError
from ..spec import TINY_MODELS
from ..tasks import TASKS
from .evaluation import eval_arguments
from .kernels.varlen import NAME as VARLEN
from .kernels.varlen import refuse_masks
from .kernels.varlen import register as register_varlen
from .tracking.identity import TRACKERS

if TYPE_CHECKING:
    from ..spec.model import JobSpec


class ModelUnavailable(SwiftSlurmError):
    exit_code = 2


def prepare_device_env() -> bool:
    """True when CUDA is usable; otherwise select DeepSpeed's CPU accelerator (gloo) before it is imported. Then
    imports the training stack (``import_stack``)."""
    import torch

    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import_stack()
    return cuda


# What the stack imports at its own import time and no rank of ours runs: DeepSpeed's autotuner (never started by
# us) imports mlflow when it is installed, and peft imports bitsandbytes for quantized LoRA layers (we load no
# quantized model). Together 2-3 s of CPU in every rank's start (benchmarks/rank_start.py).
UNUSED_AT_IMPORT = {"deepspeed": ("mlflow",), "peft": ("bitsandbytes",)}
# What every DeepSpeed engine imports as it starts (ZeRO's optimizer check and ZeRO-1/2/3 each import the Muon optimizer
# to ask "is this Muon?") and whose import decorates functions with ``torch.compile``: about 1 s of CPU per rank spent
# wrapping kernels that only a Muon run calls. Imported here with each wrapper made on its first call instead.
COMPILED_AT_IMPORT = ("deepspeed.runtime.zero.muon.muon_optimizer",)


class CompiledOnFirstCall:
    """``torch.compile(fn, **options)`` made when the function is first called, not when it is decorated. torch's own
    wrapper compiles on the first call too, so a run that calls it behaves the same; one that never does skips the cost."""

    def __init__(self, compile_fn, fn, options: dict[str, Any]) -> None:
        self._compile, self._fn, self._options = compile_fn, fn, options
        self._compiled: Any = None
        self.__wrapped__ = fn
        self.__name__ = getattr(fn, "__name__", "compiled")
        self.__doc__ = getattr(fn, "__doc__", None)

    def __call__(self, *args, **kwargs):
        if self._compiled is None:
            self._compiled = self._compile(self._fn, **self._options)
        return self._compiled(*args, **kwargs)


def import_stack() -> None:
    """Import transformers, then DeepSpeed and peft with the packages of ``UNUSED_AT_IMPORT`` kept out while they
    import (a ``None`` in ``sys.modules``: their ``try: import`` and ``find_spec`` checks see them missing), and
    importable again afterwards: our MLflow tracker and the 8-bit optimizer import them when a run asks.
    transformers first, so its own checks of what is installed see everything."""
    import importlib
    import sys

    importlib.import_module("transformers")
    for package, unused in UNUSED_AT_IMPORT.items():
        if package in sys.modules:
            continue
        kept_out = [name for name in unused if name not in sys.modules]
        for name in kept_out:
            sys.modules[name] = None  # type: ignore[assignment]  # import's documented "not importable" mark
        try:
            importlib.import_module(package)
        finally:
            for name in kept_out:
                if sys.modules.get(name, 0) is None:
                    del sys.modules[name]
    for module in COMPILED_AT_IMPORT:
        if module not in sys.modules:
            _import_compiling_on_first_call(module)


def _import_compiling_on_first_call(module: str) -> None:
    """Import ``module`` with ``torch.compile(fn, ...)`` returning a ``CompiledOnFirstCall``; absent in this DeepSpeed:
    nothing to do."""
    import importlib

    import torch

    real = torch.compile

    def deferred(fn=None, **options):
        if fn is None:  # @torch.compile(mode=...): the decorator, deferred too
            return lambda f: CompiledOnFirstCall(real, f, options)
        return CompiledOnFirstCall(real, fn, options)

    torch.compile = deferred  # type: ignore[assignment]
    try:
        importlib.import_module(module)
    except ImportError:
        pass
    finally:
        torch.compile = real


def load_processing(spec: JobSpec):
    """The model's processing class (what the Trainer calls it): its tokenizer, or a vision-language model's processor
    with its tokenizer and image processor (``vision.py``). The built-in tiny models build theirs in code."""
    train = spec.train
    if train.model in TINY_MODELS:
        from .tinymodel import build_processing

        return build_processing(train.model)
    from .vision import load_processing as load

    name = _named(train.model)
    return _local_first(name, lambda local_only: load(name, local_only))


def load_model_and_tokenizer(spec: JobSpec, cuda: bool, attn_implementation: str = "sdpa", processing=None):
    """(model, processing class: ``load_processing``'s, or the one given). ``tiny-llama``, ``tiny-moe`` and ``tiny-vl``
    are built in code; anything else goes through ``from_pretrained`` (local files first), with
    ``use_kernels=False``: transformers >= 5.25 otherwise replaces layers by kernels it downloads from the Hub at load
    time (``kernels-community/rotary`` on a GPU): code nobody here wrote, and on a node without internet the load
    fails ("not available in the local cache and Hugging Face Hub is in offline mode"). Our kernels are chosen by
    ``train/kernels`` instead. The Auto class follows the processing class (``vision.model_class``).
    ``task = "rm"``: the same backbone with a 1-output score head (``AutoModelForSequenceClassification``,
    ``num_labels = 1``) in place of the LM head; a causal LM checkpoint's head is dropped and the score head starts fresh."""
    import torch

    from .vision import model_class, tokenizer_of

    train = spec.train
    reward = TASKS[train.task].score_head
    if attn_implementation == VARLEN:
        register_varlen()
    if processing is None:
        processing = load_processing(spec)
    if train.model in TINY_MODELS:
        from .tinymodel import build_model

        model = build_model(len(tokenizer_of(processing)), train.max_length, train.seed, reward_head=reward, name=train.model)
        model.set_attn_implementation(attn_implementation)
        return _fitted(model, attn_implementation), processing
    import transformers

    dtype = torch.bfloat16 if train.bf16 else torch.float16 if train.fp16 else torch.float32
    auto = getattr(transformers, model_class(processing, reward))
    head: dict[str, Any] = {"num_labels": 1} if reward else {}
    name = _named(train.model)
    model = _local_first(name, lambda local_only: auto.from_pretrained(
        name, dtype=dtype, local_files_only=local_only, attn_implementation=attn_implementation, use_kernels=False, **head))
    return _fitted(model, attn_implementation), processing


def _named(model: str | None) -> str:
    if model is None:  # validate_spec requires it for the built-in trainer
        raise ModelUnavailable("cannot load a model: train.model is not set", "", "set train.model (a hub id or a local directory)")
    return model


def _local_first(name: str, load):
    """``load(local_only)`` from the local files first, then (unless HF_HUB_OFFLINE) from the Hub; ModelUnavailable
    with the reason when neither gives the model."""
    offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false")
    last: Exception | None = None
    for local_only in (True, False) if not offline else (True,):
        try:
            return load(local_only)
        except (OSError, ValueError) as exc:
            last = exc
    raise ModelUnavailable(
        f"cannot load model {name!r}",
        str(last).splitlines()[0][:200] if last else "",
        "nodes usually have no internet: download it first (`huggingface-cli download ...` into the shared "
        "HF_HOME) or set train.model to a local directory with config.json; 'tiny-llama' is a built-in test model",
    )


def _fitted(model, attn_implementation: str):
    """``model`` as loaded, with ``varlen_attn``'s refusal of padding masks (``varlen.refuse_masks``) where it runs."""
    if attn_implementation == VARLEN:
        refuse_masks(model)
    return model


def resolve_auto_checkpointing(spec: JobSpec, ds_config: dict[str, Any]) -> JobSpec:
    """``gradient_checkpointing = "auto"`` left unresolved (a spec trained without ``plan``, e.g. in-process): the
    same decision ``plan`` makes (``sizing.check.resolve_checkpointing``), so the trainer only ever sees a bool."""
    if spec.train.gradient_checkpointing != "auto":
        return spec
    from ..sizing.check import size_task

    sizing, _ = size_task(spec, ds_config or {}, read_disk=True)
    decided = sizing.checkpointing if sizing is not None else None
    on, layers = (decided.on, decided.layers if decided.on else None) if decided is not None else (True, spec.train.gradient_checkpointing_layers)
    return spec.model_copy(update={"train": spec.train.model_copy(update={"gradient_checkpointing": on,
                                                                          "gradient_checkpointing_layers": layers})})


def lora_config(train, task_type: str = "CAUSAL_LM", modules_to_save: list[str] | None = None,
                target_modules: str | list[str] | None = None, model=None):
    """peft's LoraConfig of the spec; a reward model passes ``task_type = "SEQ_CLS"`` and its score head in
    ``modules_to_save`` (trained whole and saved in the adapter); ``target_modules``: in place of the spec's.
    ``model``: the model it will wrap; an MoE's config has no dropout (``moe.config_dropout``: ``moe.restore_dropout``
    gives its projections ``train.lora_dropout`` once peft wrapped them)."""
    from peft import LoraConfig

    from . import moe

    return LoraConfig(r=train.lora_rank, lora_alpha=train.lora_alpha, lora_dropout=moe.config_dropout(model, train.lora_dropout),
                      target_modules=target_modules or train.lora_target_modules, task_type=task_type,
                      modules_to_save=modules_to_save)


def _apply_lora(model, train):
    from peft import get_peft_model

    from . import moe
    from .vision import lora_targets

    # a vision-language model: its language model's layers only
    wrapped = get_peft_model(model, lora_config(train, target_modules=lora_targets(model, train.lora_target_modules), model=model))
    moe.restore_dropout(wrapped, train.lora_dropout)
    return wrapped


def _offloads_optimizer(ds_config: dict[str, Any]) -> bool:
    section = ds_config.get("zero_optimization", {}).get("offload_optimizer") or {}
    return section.get("device") in ("cpu", "nvme")


# the weight matrices a low-rank optimizer projects (HF Trainer's optim_target_modules; fullmatch on module names)
LOW_RANK_TARGETS = [r".*attn.*", r".*mlp.*"]


def optimizer_arguments(t) -> dict[str, Any]:
    """TrainingArguments keys of ``train.optimizer``: {} for AdamW (the Trainer's default), else GaLore/APOLLO
    through the Trainer's own optimizer support with rank, projection gap and scale."""
    if t.optimizer == "adamw":
        return {}
    args = {"rank": t.galore_rank, "update_proj_gap": t.galore_update_proj_gap}
    if t.galore_scale is not None:
        args["scale"] = t.galore_scale
    return {"optim": t.optimizer, "optim_target_modules": list(LOW_RANK_TARGETS),
            "optim_args": ",".join(f"{k}={v}" for k, v in args.items())}


def training_kwargs(spec: JobSpec, output_dir: str, ds_config: dict[str, Any], cuda: bool, liger: dict[str, bool] | None = None,
                    parallelism_config=None) -> dict[str, Any]:
    """The TrainingArguments of every task (DPO's config adds its own keys): batch, schedule, saving, precision,
    DeepSpeed (none when ``ds_config`` is empty: ``train.deepspeed = "none"``, plain DDP) and the optimizer."""
    t = spec.train
    report = [r for r in t.report_to if r != "none" and r not in TRACKERS]  # W&B, MLflow: train/tracking's callback
    return dict(
        output_dir=output_dir,
        per_device_train_batch_size=t.per_device_train_batch_size,
        gradient_accumulation_steps=t.gradient_accumulation_steps,
        learning_rate=t.learning_rate,
        max_grad_norm=t.max_grad_norm,  # DeepSpeed's gradient_clipping "auto" takes it
        ddp_timeout=t.ddp_timeout or 1800,  # HF's default, the same 30 minutes as our DEEPSPEED_TIMEOUT
        weight_decay=t.weight_decay,
        warmup_steps=t.warmup_ratio,  # a float below 1 is a ratio of the total steps
        lr_scheduler_type=t.lr_scheduler_type,
        max_steps=t.max_steps if t.max_steps is not None else -1,
        num_train_epochs=t.epochs,
        logging_steps=t.logging_steps,
        logging_first_step=True,
        logging_nan_inf_filter=False,  # applied on the device instead (trainer.SwiftTrainer.training_step): no host read per step
        save_strategy="steps",
        save_steps=t.save_steps,
        save_total_limit=None,  # retention is checkpoint.prune's job
        seed=t.seed,
        data_seed=t.seed,
        bf16=t.bf16,
        fp16=t.fp16,
        # transformers' own names (gradient_checkpointing* are their deprecated aliases); every layer is enabled here,
        # and trainer.RecomputeFirstLayers keeps train.gradient_checkpointing_layers of them at the start of training
        activation_checkpointing=bool(t.gradient_checkpointing),
        activation_checkpointing_kwargs={"use_reentrant": False} if t.gradient_checkpointing else None,
        deepspeed=ds_config or None,
        use_cpu=not cuda,
        report_to=report or "none",
        remove_unused_columns=False,
        dataloader_num_workers=t.dataloader_num_workers,
        dataloader_pin_memory=t.dataloader_pin_memory and cuda,
        # a pinned batch is copied to the GPU without waiting for the copy (and so for the previous step's work)
        accelerator_config={"non_blocking": bool(t.dataloader_pin_memory and cuda)},
        use_liger_kernel=liger is not None,  # kernels.resolve_liger: None = off, else transformers' liger_kernel_config
        liger_kernel_config=liger or None,
        disable_tqdm=True,
        save_only_model=False,
        ddp_find_unused_parameters=False,  # plain DDP (deepspeed = "none"): every trainable weight gets a gradient
        parallelism_config=parallelism_config,  # [parallel] sequence_parallel: Accelerate's DeepSpeed Ulysses (train/parallel.py)
        **optimizer_arguments(t),
        **eval_arguments(spec),  # train.eval_*: evaluation steps, batch, the metric of the best checkpoint
    )


def training_arguments(spec: JobSpec, output_dir: str, ds_config: dict[str, Any], cuda: bool, liger: dict[str, bool] | None = None,
                       parallelism_config=None):
    from transformers import TrainingArguments

    return TrainingArguments(**training_kwargs(spec, output_dir, ds_config, cuda, liger, parallelism_config))


# The classes GaLore/APOLLO keep in their optimizer state (the projection of each matrix): a resume loads the
# optimizer with torch.load(weights_only=True), which refuses any class it was not told is safe.
PROJECTOR_CLASSES = {
    "galore": [("galore_torch.galore_projector", "GaLoreProjector")],
    "apollo": [("apollo_torch.random_projector", "GradientProjector"), ("apollo_torch.svd_projector", "GaLoreProjector")],
}


def allow_low_rank_optimizer_state(optimizer: str) -> None:
    """Let a resume load the projector objects of ``train.optimizer`` (plain data: matrices, ranks, seeds)."""
    import importlib

    import torch

    for module, name in PROJECTOR_CLASSES.get(optimizer.split("_")[0], []):
        torch.serialization.add_safe_globals([getattr(importlib.import_module(module), name)])


class OptimizerUnavailable(SwiftSlurmError):
    exit_code = 2


def check_optimizer(optimizer: str, cuda: bool) -> None:
    """``train.optimizer`` can run on this node: its package is installed, and the 8-bit one has a GPU."""
    import importlib.util

    if optimizer == "adamw":
        return
    package = "galore_torch" if optimizer.startswith("galore") else "apollo_torch"
    if importlib.util.find_spec(package) is None:
        raise OptimizerUnavailable(f"train.optimizer = {optimizer!r} needs the {package} package", "not installed on this node",
                                   "pip install 'swiftslurm[galore]' (or the train extra) in the job's environment")
    if optimizer == "galore_adamw_8bit" and not cuda:
        raise OptimizerUnavailable("train.optimizer = 'galore_adamw_8bit' needs a GPU (bitsandbytes' 8-bit optimizer)",
                                   "no CUDA device on this node", "use galore_adamw on CPU nodes")


class OffloadUnavailable(SwiftSlurmError):
    exit_code = 2


def nvme_offloads(ds_config: dict[str, Any]) -> list[str]:
    """The ZeRO sections of ``ds_config`` that offload to NVMe (pure)."""
    zero = ds_config.get("zero_optimization", {}) or {}
    return [key for key in ("offload_optimizer", "offload_param") if (zero.get(key) or {}).get("device") == "nvme"]


def check_offload(ds_config: dict[str, Any]) -> None:
    """NVMe offload swaps through DeepSpeed's async_io op (libaio): refuse here, with the reason, when the op
    cannot build on this node, rather than fail deep inside the engine's start-up."""
    sections = nvme_offloads(ds_config)
    if not sections:
        return
    from deepspeed.ops.op_builder import AsyncIOBuilder

    if not AsyncIOBuilder().is_compatible(verbose=False):
        raise OffloadUnavailable(
            "NVMe offload needs DeepSpeed's async_io op, which cannot build on this node",
            f"zero_optimization.{' and '.join(sections)} device = 'nvme'; libaio (its headers and library) not found",
            "install libaio-dev (libaio-devel) on the nodes or in the image, or offload to \"cpu\" (deepspeed = \"zero3_offload\")")
