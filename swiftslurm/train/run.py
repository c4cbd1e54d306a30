"""The run of every training task: ``train(spec, dist, ds_config, output_dir, resume_from, should_stop)``.

Called in-process on every rank by ``swiftslurm.node.runtime`` after MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE/
LOCAL_RANK were exported. Task-neutral: the task (``tasks.task_for``: SFT, PT, DPO, RM, KTO, GRPO) supplies the
arguments, the data and the Trainer class at one seam; everything else is here, in phases: the kernels, the start
point (resume), the model, the instruments (metrics, watchdog, deadline), the trackers, the Trainer with its
DeepSpeed integration (the dict from ``dsconfig.build_for_spec``), verified checkpoints, and the result
(``result.py``). Without CUDA it runs on the CPU: DS_ACCELERATOR=cpu, gloo.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from ..errors import SwiftSlurmError
from ..taskdir import HANG_FILE, METRICS_FILE
from ..tasks import TASKS
from . import vision
from .build import (
    _offloads_optimizer,
    allow_low_rank_optimizer_state,
    check_offload,
    check_optimizer,
    load_model_and_tokenizer,
    load_processing,
    prepare_device_env,
)
from .health import startup
from .result import TrainResult, write_summary
from .tasks import task_for

if TYPE_CHECKING:
    from ..slurm.distenv import DistEnv
    from ..spec.model import JobSpec
    from .trainer import RunFacts  # torch and transformers: imported when training starts

log = logging.getLogger("swiftslurm.train")


def train(spec: JobSpec, dist: DistEnv, ds_config: dict[str, Any], output_dir: str, resume_from: str | bool | None,
          should_stop: Callable[[], bool]) -> TrainResult:
    """Train one task on this rank. Returns when max_steps/epochs are done or a walltime stop saved.

    ``resume_from``: True = the newest verified checkpoint, chosen by rank 0 and checked by every rank
    (``resume.resolve``), else ``train.resume_from`` (``resume_from.resolve_start``); a path = that checkpoint
    (checked by every rank); None = a fresh start.

    Everything this starts (the weights-only ``torch.load``, NVMe swap folders, the ``deepspeed.comm`` timer patch,
    the GPU sampler thread, the progress watchdog) is owned by one ExitStack: whichever phase fails, each is undone.
    """
    started = time.perf_counter()
    from ..checkpoint.fingerprint import training_fingerprint
    from .build import resolve_auto_checkpointing

    spec = resolve_auto_checkpointing(spec, ds_config)  # plan resolved it already for submitted jobs
    from .health.shutdown import shut_down_distributed

    fingerprint = training_fingerprint(spec, ds_config)  # before anything may fill in the ds config
    cuda = prepare_device_env()
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:  # the export step set it (distenv.child_env): torch may have started its pool
        import torch

        torch.set_num_threads(int(threads))
    check_optimizer(spec.train.optimizer, cuda)
    check_offload(ds_config)
    import transformers

    transformers.set_seed(spec.train.seed)
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    task = task_for(spec.train.task)
    processing = load_processing(spec)  # the tokenizer, or a vision-language model's processor (vision.py)
    planned_spec = spec  # as written: what the checkpoints' fingerprints record and a resume compares
    spec, fitted = vision.fit_spec(spec, processing)
    if fitted and dist.rank == 0:
        log.warning("vision-language model: %s", fitted)
    kern = _choose_kernels(spec, ds_config, cuda, task)
    with contextlib.ExitStack() as stack:
        from ..checkpoint.formats.safeload import weights_only_loads

        stack.enter_context(weights_only_loads())  # no checkpoint file runs code in this rank (DeepSpeed's loads too)
        planned_ds_config = ds_config
        ds_config = _isolate_nvme_swap(ds_config, dist, output_dir, stack)
        # before the model: ZeRO-3 init needs it
        from . import parallel

        startup.mark("joining the process group (TrainingArguments: the rendezvous and DeepSpeed's comm start)")
        args = task.arguments(spec, output_dir, ds_config, cuda, kern.liger, parallel.parallelism_config(spec, kern.attn))
        startup.mark("choosing the start point (rank 0 verifies the newest checkpoint)")
        start, resume_from = _start_point(resume_from, planned_spec, dist, output_dir, args, planned_ds_config)
        startup.mark("loading the model")
        model, tok, params = _build_model(spec, cuda, kern, start, task, dist, processing)
        startup.mark("preparing the data")
        if kern.liger is None:  # the model's type ruled Liger out (fit_liger_to_model): the Trainer must not apply it
            args.use_liger_kernel, args.liger_kernel_config = False, None
        from . import evaluation

        dataset, collator, eval_dataset = evaluation.task_data(task, spec, args, tok, model, kern.attn, output_dir)
        if dist.rank == 0:
            from .kernels import choose as kernels

            log.warning("kernels: attention %s (%s); Liger %s (%s); FP8 %s (%s); packing %s", kern.attn, kern.attn_why,
                        kernels.liger_names(kern.liger), kern.liger_why, f"{kern.fp8_layers} layers" if kern.fp8 else "off",
                        kern.fp8_why, task.describe_data(spec, dataset))
        tools = _instruments(spec, dist, output_dir, should_stop, stack)
        tools.callbacks += evaluation.callbacks(spec)  # train.eval_*: the best checkpoint's save, early stopping
        tools.callbacks += _open_trackers(spec, dist, output_dir, start, stack)  # after metrics.jsonl's: a tracker never holds a step metrics.jsonl lacks
        from .trainer import RunFacts, StoppedBeforeFirstStep

        job = RunFacts(spec.job.name, spec.train.train_type, spec.checkpoint.checksum, spec.checkpoint.keep,
                       spec.slurm.signal_grace_s, parallel.global_batch(spec), fingerprint, kern.packs,
                       _zero_stage(ds_config), fuses_lora(spec), **parallel.degrees_json(spec),
                       async_save=background_saves(spec, cuda),
                       lora_dropout=spec.train.lora_dropout if spec.train.train_type == "lora" else 0.0)
        trainer = _build_trainer(spec, task, cuda, kern.attn, model, tok, args, dataset, collator, tools, job, params, ds_config,
                                 eval_dataset)
        try:
            startup.mark("starting DeepSpeed (deepspeed.initialize) and loading the checkpoint")
            trainer.train(resume_from_checkpoint=resume_from)
            trainer.finish_saves()  # the run's last save is waited for already; a save in flight is committed now
        except StoppedBeforeFirstStep:  # the walltime signal came while loading: tools.schedule says so
            pass
        except SwiftSlurmError as exc:
            if not exc.agreed:
                raise
            # one verdict raised alike on every rank (a GRPO reward function failed): leave the groups together, as
            # after a finished run; the traceback's frames hold the trainer, and with it the groups' threads
            exc.__traceback__ = None
            trainer.accelerator.free_memory()
            del trainer, model
            shut_down_distributed()
            raise exc from None
    from .kernels import choose as kernels

    kernels_used = {"attn_implementation": kern.attn, "liger": kernels.liger_names(kern.liger), "packing": kern.packs, "task": task.name,
                    "fp8_layers": kern.fp8_layers,
                    "gradient_checkpointing": bool(getattr(trainer.model, "is_activation_checkpointing", False)),
                    "checkpointed_layers": recomputing_layers(trainer.model)}
    kernels_used.update(stop_reason=evaluation.stop_reason(trainer), **evaluation.best_of(trainer, output_dir))
    result = _result(trainer, tools.schedule, output_dir, tools.metrics_path, time.perf_counter() - started, dist.rank, kernels_used)
    # The DeepSpeed engine holds the process groups, and its gradient hooks (held from C++) keep it alive past
    # `del`: engine.destroy() (through accelerate) removes them, so the collection below frees it and the groups.
    trainer.accelerator.free_memory()
    del trainer, model
    shut_down_distributed()  # no rank may abort at exit: train/shutdown.py says why
    return result


def background_saves(spec: JobSpec, cuda: bool) -> bool:
    """``checkpoint.async_save`` on this node: plan turned "auto" into a bool for submitted jobs; a run without a
    plan takes "auto" as plan does where ``slurm.mem`` is unset (``sizing.check.resolve_async_save``): on with a GPU."""
    setting = spec.checkpoint.async_save
    return setting is True or (setting == "auto" and cuda)


# ---------------------------------------------------------------- the phases of train()


@dataclass
class _Kernels:
    """The attention implementation, Liger kernels and packing of this run, each with why."""

    attn: str
    attn_why: str
    liger: dict[str, bool] | None
    liger_why: str
    packs: bool
    fp8: bool = False
    fp8_why: str = "off in the spec"
    fp8_layers: int = 0


@dataclass
class _Instruments:
    """The measurements and stop logic handed to the Trainer (their undo is on the ExitStack)."""

    meter: Any
    watchdog: Any
    deadline: Any
    schedule: Any
    callbacks: list[Any]
    metrics_path: Path


def _choose_kernels(spec: JobSpec, ds_config: dict[str, Any], cuda: bool, task) -> _Kernels:
    from .kernels import choose as kernels
    from .kernels import fp8

    node = kernels.node_facts(cuda)
    packs = spec.train.packing and TASKS[spec.train.task].packs
    attn, attn_why = kernels.resolve_attention(spec.train.attn_implementation, packs, node, spec.train.max_length,
                                               half=spec.train.bf16 or spec.train.fp16)
    fp8_on, fp8_why = fp8.resolve(spec.train.fp8, cuda, node.capability, node.torchao)
    liger, liger_why = kernels.resolve_liger(spec.train.use_liger_kernel, _zero_stage(ds_config), node,
                                             compiled=compiles(spec, fp8_on))
    if TASKS[task.name].trl and liger is not None:  # TRL scores these with its own pass; Liger was measured for SFT only
        liger, liger_why = None, f"not used by {task.name}"
    return _Kernels(attn, attn_why, liger, liger_why, packs, fp8_on, fp8_why)


def compiles(spec: JobSpec, fp8_on: bool) -> bool:
    """The decoder layers are compiled: ``train.compile``, or FP8 (torchao fuses its casts through torch.compile; not
    when emulated on the CPU for the tests, where inductor would only cost time)."""
    from .kernels import fp8

    return spec.train.compile or (fp8_on and not fp8.emulated())


def _isolate_nvme_swap(ds_config: dict[str, Any], dist: DistEnv, output_dir: str, stack: contextlib.ExitStack) -> dict[str, Any]:
    """This rank's ds config with per-job/task NVMe swap folders; removing this rank's swap files is on the stack."""
    from . import nvme_swap

    ds_config, swap_folders = nvme_swap.isolate(ds_config, dist, output_dir)
    stack.callback(nvme_swap.cleanup, swap_folders, dist.rank)
    return ds_config


def _start_point(resume_from: str | bool | None, spec: JobSpec, dist: DistEnv, output_dir: str, args, planned_ds_config: dict[str, Any]):
    """(start, the checkpoint the Trainer resumes): the process group exists now, so all ranks agree on the own
    newest verified checkpoint, else ``train.resume_from`` (resume_from.py); another DP size is converted."""
    from ..checkpoint.fingerprint import check_parallel_degrees, check_spec_drift
    from . import parallel
    from .health.shutdown import shut_down_distributed
    from .resume import source as resume_from_mod
    from .resume import worldsize

    try:
        start = resume_from_mod.resolve_start(resume_from, spec, output_dir, dist.rank, dist.node)
    except SwiftSlurmError as exc:
        if getattr(exc, "agreed", False):  # rank 0's verdict, raised on every rank: leave together, or a rank
            shut_down_distributed()  # aborts at exit (SIGABRT instead of the error's exit code; shutdown.py)
        raise
    resume_from = start.full_resume
    if resume_from:  # the agreed checkpoint, on every rank: the same verdict everywhere
        check_parallel_degrees(resume_from, parallel.degrees_json(spec))
        check_spec_drift(resume_from, spec, planned_ds_config, log)
    resume_from = worldsize.adapt(resume_from, output_dir, dist, args, spec.checkpoint.checksum,  # another DP size: convert
                                  spec.checkpoint.convert_timeout_s)
    return start, resume_from


def _open_trackers(spec: JobSpec, dist: DistEnv, output_dir: str, start, stack: contextlib.ExitStack) -> list[Any]:
    """The W&B / MLflow callback (train/tracking/): a resume from this task's own checkpoint continues its run."""
    from ..fsutil import is_inside
    from .tracking.session import open_trackers

    own = start.source == "own" or (start.source == "explicit" and bool(start.path) and is_inside(output_dir, start.path))
    return open_trackers(spec, dist, output_dir, own, stack)


def fuses_lora(spec: JobSpec) -> bool:
    """``train.fused_lora`` applies: LoRA, and no ``compile`` (which traces peft's forward) and no FP8 (whose base layer
    the fused kernel would bypass; ``"auto"`` is off)."""
    return spec.train.train_type == "lora" and spec.train.fused_lora and not spec.train.compile and spec.train.fp8 is not True


def _build_model(spec: JobSpec, cuda: bool, kern: _Kernels, start, task, dist: DistEnv, processing):
    """(model, processing class (tokenizer or processor), (total, trainable) parameters): loaded, fitted to the kernels, weights-only loaded,
    wrapped by the task (LoRA), MLPs tiled. ``kern`` is updated when the model's head size rules out a kernel, or its
    type Liger's."""
    from . import moe, parallel
    from .kernels import choose as kernels
    from .resume import source as resume_from_mod

    model, processing = load_model_and_tokenizer(spec, cuda, kern.attn, processing)
    if kern.attn == kernels.VARLEN:  # the flash kernel's head dimensions: known once the model's config is
        text = model.config.get_text_config()
        fitted = kernels.fit_to_model(spec.train.attn_implementation, kern.attn, kern.attn_why,
                                      getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
        if fitted[0] != kern.attn:
            model.set_attn_implementation(fitted[0])
        kern.attn, kern.attn_why = fitted
    model_type = getattr(model.config, "model_type", None)
    kern.liger, kern.liger_why = kernels.fit_liger_to_model(
        spec.train.use_liger_kernel, kern.liger, kern.liger_why, model_type,
        kernels.liger_import_problem(model_type) if kern.liger is not None else None)
    # an MoE: the router's auxiliary loss on; the banner names the experts' kernel (Liger's SwiGLU may replace them)
    routed = moe.configure(model, spec.train.router_aux_loss_coef, bool(kern.liger and kern.liger.get("swiglu")))
    if routed is not None and dist.rank == 0:
        log.warning("mixture of experts: %s", routed.banner())
    parallel.check_model(spec, model)
    parallel.init_comm(spec)
    tok = vision.tokenizer_of(processing)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    resume_from_mod.load_weights(model, start, "base", spec.train.train_type)  # weights only: before LoRA wraps it
    total_params = sum(p.numel() for p in model.parameters())
    if kern.fp8:  # before LoRA wraps the layers (the float8 layer becomes peft's base) and before DeepSpeed sees them
        from .kernels import fp8

        kern.fp8_layers = fp8.convert(model, spec.train.fp8_recipe)
        if dist.rank == 0:
            log.warning("train.fp8: %d linear layers run their matmuls in FP8 (torchao %s scaling; %s)", kern.fp8_layers,
                        spec.train.fp8_recipe, kern.fp8_why)
    model = task.prepare_model(model, spec)
    if routed is not None and dist.rank == 0 and spec.train.train_type == "lora" and hasattr(model, "peft_config"):
        log.warning("mixture of experts, LoRA: %s", moe.adapted(model, spec.train.lora_dropout))  # TRL's tasks: after_trl_init
    tiled = parallel.tile_mlps(spec, model)  # after LoRA wraps the projections, before DeepSpeed sees the model
    if tiled and dist.rank == 0:
        log.warning("parallel.tiled_mlp: %d MLPs compute in slices of the sequence (recomputed in the backward)", tiled)
    if fuses_lora(spec):  # SFT, PT: the task wrapped it above (TRL's tasks wrap it later: trainer.SwiftTrainer.after_trl_init)
        from .kernels import lora

        lora.install(model, say=dist.rank == 0)
    if compiles(spec, kern.fp8):
        from .kernels.compile import compile_layers

        compiled = compile_layers(model)
        if dist.rank == 0:
            log.warning("train.compile: %d decoder layers compiled (torch.compile, one graph per layer)", compiled)
    if spec.train.train_type == "lora" and task.name in ("sft", "pt"):  # DPO: TRL wraps it (weights-only is refused at validate)
        resume_from_mod.load_weights(model, start, "adapter", spec.train.train_type)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return model, processing, (total_params, trainable)


def recomputing_layers(model) -> tuple[int, int]:
    """(decoder layers that recompute their activations in the backward, decoder layers): what the model on the node
    runs with (transformers' per-layer flag: ``activation_checkpointing_enable``, then ``RecomputeFirstLayers``)."""
    from .trainer import decoder_layers

    layers = decoder_layers(model)
    return sum(bool(getattr(m, "gradient_checkpointing", False)) for m in layers), len(layers)


def _instruments(spec: JobSpec, dist: DistEnv, output_dir: str, should_stop: Callable[[], bool], stack: contextlib.ExitStack) -> _Instruments:
    """The comm timer (patches ``deepspeed.comm``), the GPU sampler (a thread), the watchdog, the deadline watch and
    the callbacks; every one that starts something is undone by ``stack``."""
    from .health import deadline
    from .health.gpuutil import GpuSampler
    from .health.metrics import CommTimer, StepMeter
    from .health.watchdog import ProgressWatchdog
    from .trainer import MetricsFileCallback, ScheduleCallback

    comm = CommTimer().install()
    stack.callback(comm.uninstall)
    gpu = GpuSampler.for_this_rank()  # None: no CUDA or no NVML here, the gpu_util fields stay absent
    if gpu is not None:
        stack.callback(gpu.stop)
    meter = StepMeter(comm, gpu)
    # stacks and flight record of a rank that stops stepping; rank 0 logs which collective each rank is in
    watchdog = ProgressWatchdog(dist.rank, float(spec.train.ddp_timeout or 1800), world_size=dist.world_size, node=dist.node,
                                hang_file=Path(output_dir) / HANG_FILE)  # used under the in-job restart supervisor only
    stack.callback(watchdog.stop)
    watch = deadline.watch_for(spec, dist, output_dir, lambda: meter.last_step_s)  # save before USR2 if it would not fit
    schedule = ScheduleCallback(should_stop, list(spec.checkpoint.forced_save_fractions), meter, watchdog, deadline=watch)
    callbacks: list[Any] = [schedule]
    if spec.train.gradient_checkpointing is True and spec.train.gradient_checkpointing_layers:
        from .trainer import RecomputeFirstLayers

        callbacks.append(RecomputeFirstLayers(spec.train.gradient_checkpointing_layers))
    metrics_path = Path(output_dir) / METRICS_FILE
    if dist.rank == 0:
        callbacks.append(MetricsFileCallback(metrics_path))
    if spec.train.straggler_window:  # after the schedule: its on_step_end has ended the meter's step
        from .health.metrics import MetricsFile
        from .health.straggler import StragglerWatch
        from .trainer import StragglerCallback

        callbacks.append(StragglerCallback(StragglerWatch(
            spec.train.straggler_window, spec.train.straggler_factor, meter, dist.rank, dist.node, dist.requeue_id or dist.job_id,
            dist.executor, output_dir, MetricsFile(metrics_path) if dist.rank == 0 else None)))
    return _Instruments(meter, watchdog, watch, schedule, callbacks, metrics_path)


def _build_trainer(spec: JobSpec, task, cuda: bool, attn: str, model, tok, args, dataset, collator, tools: _Instruments,
                   job: RunFacts, params: tuple[int, int], ds_config: dict[str, Any], eval_dataset=None):
    from . import moe
    from .health.metrics import flops_per_token

    trainer = task.trainer(
        spec, cuda, attn, model=model, args=args, train_dataset=dataset, eval_dataset=eval_dataset, data_collator=collator,
        processing_class=tok, callbacks=tools.callbacks, meter=tools.meter, job=job,
        flops_per_token=flops_per_token(moe.active_params(model, params[0]), params[1]), cpu_adam=cuda and _offloads_optimizer(ds_config),
    )
    trainer.deadline = tools.deadline
    if spec.train.optimizer != "adamw":
        allow_low_rank_optimizer_state(spec.train.optimizer)
    return trainer


def _zero_stage(ds_config: dict[str, Any]) -> int:
    return int(ds_config.get("zero_optimization", {}).get("stage", 0) or 0)


def _result(trainer, schedule, output_dir: str, metrics_path: Path, wall_s: float, rank: int,
            kernels_used: dict[str, Any]) -> TrainResult:
    history = trainer.state.log_history
    losses = [h["loss"] for h in history if "loss" in h]
    speeds = [h["tokens_per_s"] for h in history if "tokens_per_s" in h]
    accuracies = [h["rewards/accuracies"] for h in history if "rewards/accuracies" in h] or \
        [h["accuracy"] for h in history if "accuracy" in h]  # TRL's RewardTrainer logs "accuracy"
    margins = [h["rewards/margins"] for h in history if "rewards/margins" in h] or \
        [h["margin"] for h in history if "margin" in h]  # ... and "margin"
    rewards = [h["reward"] for h in history if isinstance(h.get("reward"), (int, float))]
    useful = int(sum(h.get("useful_tokens", 0) for h in history))
    total = int(sum(h.get("total_tokens", 0) for h in history))
    step_s = sum(h["useful_tokens"] / h["useful_tokens_per_s"] for h in history
                 if h.get("useful_tokens") and h.get("useful_tokens_per_s"))
    runs = Path(output_dir) / "runs"
    result = TrainResult(
        global_step=trainer.state.global_step,
        final_loss=losses[-1] if losses else None,
        tokens_per_s=sum(speeds) / len(speeds) if speeds else None,
        stopped_for_requeue=schedule.stopped_for_requeue,
        checkpoints=list(trainer.committed),
        save_seconds=list(trainer.save_seconds),
        tensorboard_dir=str(runs) if runs.exists() else None,
        metrics_file=str(metrics_path) if rank == 0 else None,
        wall_s=wall_s,
        optimizer=trainer.optimizer_name,
        useful_tokens=useful,
        total_tokens=total,
        useful_tokens_per_s=useful / step_s if step_s > 0 else None,
        padding_ratio=1.0 - useful / total if total else None,
        reward_accuracy=accuracies[-1] if accuracies else None,
        reward_margin=margins[-1] if margins else None,
        rewards=(rewards[0], rewards[-1]) if rewards else (None, None),
        **kernels_used,
    )
    if rank == 0:
        print(write_summary(result, output_dir, losses[0] if losses else None), flush=True)
    return result
