"""The built-in trainer: ``train(spec, dist, ds_config, output_dir, resume_from, should_stop)``.

SFT here; ``train.task = "dpo"`` swaps in ``dpo.DPOTask`` at one seam (arguments, data, Trainer class),
``"pt"`` ``pt.PTTask`` (SFT's trainer on raw text), ``"rm"``/``"kto"`` ``rm.RewardTask``/``kto.KTOTask`` and
``"grpo"`` ``grpo.GRPOTask``.

Called in-process on every rank by ``swiftslurm.node.runtime.run_task`` after MASTER_ADDR/MASTER_PORT/
RANK/WORLD_SIZE/LOCAL_RANK were exported. HF ``Trainer`` with its DeepSpeed integration (the dict from
``dsconfig.build_for_spec``), peft LoRA or full fine-tuning, verified checkpoints, TensorBoard and
metrics.jsonl under ``output_dir``. Without CUDA it runs on the CPU: DS_ACCELERATOR=cpu, gloo.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from ...errors import SwiftSlurmError
from ...taskdir import HANG_FILE, METRICS_FILE, SUMMARY_FILE
from ...taskdir import TOKEN_CACHE_DIR as CACHE_DIR  # under output_dir: a requeue finds the tokens there
from ..build import (  # noqa: F401 (re-exported)
    ModelUnavailable,
    _apply_lora,
    _offloads_optimizer,
    allow_low_rank_optimizer_state,
    check_offload,
    check_optimizer,
    load_model_and_tokenizer,
    prepare_device_env,
    training_arguments,
)
from ..health import startup

if TYPE_CHECKING:
    from ...slurm.distenv import DistEnv
    from ...spec.model import JobSpec

log = logging.getLogger("swiftslurm.train")


@dataclass
class TrainResult:
    global_step: int
    final_loss: float | None
    tokens_per_s: float | None
    stopped_for_requeue: bool
    checkpoints: list[str] = field(default_factory=list)
    save_seconds: list[float] = field(default_factory=list)
    tensorboard_dir: str | None = None
    metrics_file: str | None = None
    wall_s: float = 0.0
    optimizer: str = ""
    useful_tokens: int = 0  # non-padding tokens trained on in this run (all ranks; since the start or resume)
    total_tokens: int = 0  # every position computed, padding included
    useful_tokens_per_s: float | None = None
    padding_ratio: float | None = None
    attn_implementation: str = ""
    liger: str = "off"  # kernels.liger_names: "off", "all", or the kernels on ("rope+rms_norm+swiglu")
    packing: bool = False
    task: str = "sft"
    reward_accuracy: float | None = None  # DPO: the last logged rewards/accuracies; rm: the last logged accuracy
    reward_margin: float | None = None  # rm: the last logged margin; KTO: the last logged rewards/margins
    stop_reason: str = ""  # why it ended before max_steps/epochs, other than a walltime stop (early stopping)
    eval_loss: float | None = None  # train.eval_*: the last eval_loss
    metric_for_best_model: str = ""
    best_metric: float | None = None  # the best value of metric_for_best_model, at best_step
    best_step: int | None = None
    best_checkpoint: str | None = None  # what latest_best names
    rewards: tuple[float | None, float | None] = (None, None)  # GRPO: the first and last logged mean reward


class SFTTask:
    """What differs between tasks, behind one seam: the arguments, the data and the Trainer class.
    ``dpo.DPOTask`` is the other one; everything else in ``train`` (resume, callbacks, checkpoints,
    metrics, the summary) is shared.

    Evaluation (``train.eval_dataset`` / ``train.eval_split``, ``train/evaluation.py``) comes through the same
    seam: ``data()`` is called once more for the eval set, with a copy of the spec whose ``train.dataset`` names
    the eval files (for a split: the held-out records, split off in shared code before any task reads them), and
    its dataset goes to ``trainer(..., eval_dataset=...)``. A task gets evaluation by (1) reading its records from
    ``spec.train.dataset`` only in ``data()`` and (2) passing ``**kwargs`` (``eval_dataset`` among them) on to its
    Trainer; one whose eval set is built otherwise adds ``eval_data(spec, args, tok, model, attn, output_dir)``
    returning the eval dataset. What its evaluation logs (``eval_loss``, ...) is listed in
    ``spec/eval_rules.TASK_METRICS``, which ``metric_for_best_model`` is checked against."""

    name = "sft"

    def arguments(self, spec: JobSpec, output_dir: str, ds_config: dict[str, Any], cuda: bool, liger: dict[str, bool] | None, parallelism_config=None):
        return training_arguments(spec, output_dir, ds_config, cuda, liger, parallelism_config)

    def prepare_model(self, model, spec: JobSpec):
        if spec.train.train_type == "lora":
            model = _apply_lora(model, spec.train)
            if spec.train.gradient_checkpointing:
                model.enable_input_require_grads()
        return model

    def data(self, spec: JobSpec, args, tok, model, attn: str, output_dir: str):
        return _data(spec, args, tok, model, attn, output_dir, self.name)

    def describe_data(self, spec: JobSpec, dataset) -> str:
        return (f"on: {len(dataset)} rows of {spec.train.max_length} tokens, {dataset.padding_ratio():.1%} padding"
                if spec.train.packing else "off (each micro-batch padded to its longest sample)")

    def trainer(self, spec: JobSpec, cuda: bool, attn: str, **kwargs):
        from ..trainer import SFTTrainer

        return SFTTrainer(**kwargs)


def _task(spec: JobSpec):
    if spec.train.task == "dpo":
        from .dpo import DPOTask

        return DPOTask()
    if spec.train.task == "pt":
        from .pt import PTTask

        return PTTask()
    if spec.train.task in ("rm", "kto"):
        from .kto import KTOTask
        from .rm import RewardTask

        return RewardTask() if spec.train.task == "rm" else KTOTask()
    if spec.train.task == "grpo":
        from .grpo import GRPOTask

        return GRPOTask()
    return SFTTask()


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
    from ...checkpoint.fingerprint import training_fingerprint
    from ..build import resolve_auto_checkpointing

    spec = resolve_auto_checkpointing(spec, ds_config)  # plan resolved it already for submitted jobs
    from ..health.shutdown import shut_down_distributed

    fingerprint = training_fingerprint(spec, ds_config)  # before anything may fill in the ds config
    cuda = prepare_device_env()
    check_optimizer(spec.train.optimizer, cuda)
    check_offload(ds_config)
    import transformers

    transformers.set_seed(spec.train.seed)
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    task = _task(spec)
    kern = _choose_kernels(spec, ds_config, cuda, task)
    with contextlib.ExitStack() as stack:
        from ..resume.safeload import weights_only_loads

        stack.enter_context(weights_only_loads())  # no checkpoint file runs code in this rank (DeepSpeed's loads too)
        planned_ds_config = ds_config
        ds_config = _isolate_nvme_swap(ds_config, dist, output_dir, stack)
        # before the model: ZeRO-3 init needs it
        from .. import parallel

        startup.mark("joining the process group (TrainingArguments: the rendezvous and DeepSpeed's comm start)")
        args = task.arguments(spec, output_dir, ds_config, cuda, kern.liger, parallel.parallelism_config(spec, kern.attn))
        startup.mark("choosing the start point (rank 0 verifies the newest checkpoint)")
        start, resume_from = _start_point(resume_from, spec, dist, output_dir, args, planned_ds_config)
        startup.mark("loading the model")
        model, tok, params = _build_model(spec, cuda, kern, start, task, dist)
        startup.mark("preparing the data")
        if kern.liger is None:  # the model's type ruled Liger out (fit_liger_to_model): the Trainer must not apply it
            args.use_liger_kernel, args.liger_kernel_config = False, None
        from .. import evaluation

        dataset, collator, eval_dataset = evaluation.task_data(task, spec, args, tok, model, kern.attn, output_dir)
        if dist.rank == 0:
            from ..kernels import choose as kernels

            log.warning("kernels: attention %s (%s); Liger %s (%s); packing %s", kern.attn, kern.attn_why,
                        kernels.liger_names(kern.liger), kern.liger_why, task.describe_data(spec, dataset))
        tools = _instruments(spec, dist, output_dir, should_stop, stack)
        tools.callbacks += evaluation.callbacks(spec)  # train.eval_*: the best checkpoint's save, early stopping
        tools.callbacks += _open_trackers(spec, dist, output_dir, start, stack)  # after metrics.jsonl's: a tracker never holds a step metrics.jsonl lacks
        job = {"name": spec.job.name, "train_type": spec.train.train_type, "checksum": spec.checkpoint.checksum,
               "keep": spec.checkpoint.keep, "signal_grace_s": spec.slurm.signal_grace_s,
               "global_batch": parallel.global_batch(spec), "spec_fingerprint": fingerprint, "packing": kern.packs,
               "zero_stage": _zero_stage(ds_config), "fused_lora": fuses_lora(spec), **parallel.degrees_json(spec)}
        trainer = _build_trainer(spec, task, cuda, kern.attn, model, tok, args, dataset, collator, tools, job, params, ds_config,
                                 eval_dataset)
        from ..trainer import StoppedBeforeFirstStep

        try:
            startup.mark("starting DeepSpeed (deepspeed.initialize) and loading the checkpoint")
            trainer.train(resume_from_checkpoint=resume_from)
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
    from ..kernels import choose as kernels

    kernels_used = {"attn_implementation": kern.attn, "liger": kernels.liger_names(kern.liger), "packing": kern.packs, "task": task.name}
    kernels_used.update(stop_reason=evaluation.stop_reason(trainer), **evaluation.best_of(trainer, output_dir))
    result = _result(trainer, tools.schedule, output_dir, tools.metrics_path, time.perf_counter() - started, dist.rank, kernels_used)
    # The DeepSpeed engine holds the process groups, and its gradient hooks (held from C++) keep it alive past
    # `del`: engine.destroy() (through accelerate) removes them, so the collection below frees it and the groups.
    trainer.accelerator.free_memory()
    del trainer, model
    shut_down_distributed()  # no rank may abort at exit: train/shutdown.py says why
    return result


# ---------------------------------------------------------------- the phases of train()


@dataclass
class _Kernels:
    """The attention implementation, Liger kernels and packing of this run, each with why."""

    attn: str
    attn_why: str
    liger: dict[str, bool] | None
    liger_why: str
    packs: bool


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
    from ..kernels import choose as kernels

    node = kernels.node_facts(cuda)
    packs = spec.train.packing and spec.train.task in ("sft", "pt")
    attn, attn_why = kernels.resolve_attention(spec.train.attn_implementation, packs, node, spec.train.max_length,
                                               half=spec.train.bf16 or spec.train.fp16)
    liger, liger_why = kernels.resolve_liger(spec.train.use_liger_kernel, _zero_stage(ds_config), node,
                                             compiled=spec.train.compile)
    if task.name in ("dpo", "rm", "kto", "grpo") and liger is not None:  # TRL scores these with its own pass; Liger was measured for SFT only
        liger, liger_why = None, f"not used by {task.name}"
    return _Kernels(attn, attn_why, liger, liger_why, packs)


def _isolate_nvme_swap(ds_config: dict[str, Any], dist: DistEnv, output_dir: str, stack: contextlib.ExitStack) -> dict[str, Any]:
    """This rank's ds config with per-job/task NVMe swap folders; removing this rank's swap files is on the stack."""
    from .. import nvme_swap

    ds_config, swap_folders = nvme_swap.isolate(ds_config, dist, output_dir)
    stack.callback(nvme_swap.cleanup, swap_folders, dist.rank)
    return ds_config


def _start_point(resume_from: str | bool | None, spec: JobSpec, dist: DistEnv, output_dir: str, args, planned_ds_config: dict[str, Any]):
    """(start, the checkpoint the Trainer resumes): the process group exists now, so all ranks agree on the own
    newest verified checkpoint, else ``train.resume_from`` (resume_from.py); another DP size is converted."""
    from ...checkpoint.fingerprint import check_parallel_degrees, check_spec_drift
    from .. import parallel
    from ..health.shutdown import shut_down_distributed
    from ..resume import source as resume_from_mod
    from ..resume import worldsize

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
    from ...fsutil import is_inside
    from ..tracking.session import open_trackers

    own = start.source == "own" or (start.source == "explicit" and bool(start.path) and is_inside(output_dir, start.path))
    return open_trackers(spec, dist, output_dir, own, stack)


def fuses_lora(spec: JobSpec) -> bool:
    """``train.fused_lora`` applies: LoRA, and no ``compile`` (which traces peft's forward)."""
    return spec.train.train_type == "lora" and spec.train.fused_lora and not spec.train.compile


def _build_model(spec: JobSpec, cuda: bool, kern: _Kernels, start, task, dist: DistEnv):
    """(model, tokenizer, (total, trainable) parameters): loaded, fitted to the kernels, weights-only loaded,
    wrapped by the task (LoRA), MLPs tiled. ``kern`` is updated when the model's head size rules out a kernel, or its
    type Liger's."""
    from .. import parallel
    from ..kernels import choose as kernels
    from ..resume import source as resume_from_mod

    model, tok = load_model_and_tokenizer(spec, cuda, kern.attn)
    if kern.attn == kernels.VARLEN:  # the flash kernel's head dimensions: known once the model's config is
        text = model.config.get_text_config()
        fitted = kernels.fit_to_model(spec.train.attn_implementation, kern.attn, kern.attn_why,
                                      getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
        if fitted[0] != kern.attn:
            model.set_attn_implementation(fitted[0])
        kern.attn, kern.attn_why = fitted
    kern.liger, kern.liger_why = kernels.fit_liger_to_model(spec.train.use_liger_kernel, kern.liger, kern.liger_why,
                                                            getattr(model.config, "model_type", None))
    parallel.check_model(spec, model)
    parallel.init_comm(spec)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    resume_from_mod.load_weights(model, start, "base", spec.train.train_type)  # weights only: before LoRA wraps it
    total_params = sum(p.numel() for p in model.parameters())
    model = task.prepare_model(model, spec)
    tiled = parallel.tile_mlps(spec, model)  # after LoRA wraps the projections, before DeepSpeed sees the model
    if tiled and dist.rank == 0:
        log.warning("parallel.tiled_mlp: %d MLPs compute in slices of the sequence (recomputed in the backward)", tiled)
    if fuses_lora(spec):  # SFT, PT: the task wrapped it above (TRL's tasks wrap it later: trainer.SFTTrainer.after_trl_init)
        from ..kernels import lora

        lora.install(model, say=dist.rank == 0)
    if spec.train.compile:
        from ..kernels.compile import compile_layers

        compiled = compile_layers(model)
        if dist.rank == 0:
            log.warning("train.compile: %d decoder layers compiled (torch.compile, one graph per layer)", compiled)
    if spec.train.train_type == "lora" and task.name in ("sft", "pt"):  # DPO: TRL wraps it (weights-only is refused at validate)
        resume_from_mod.load_weights(model, start, "adapter", spec.train.train_type)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return model, tok, (total_params, trainable)


def _instruments(spec: JobSpec, dist: DistEnv, output_dir: str, should_stop: Callable[[], bool], stack: contextlib.ExitStack) -> _Instruments:
    """The comm timer (patches ``deepspeed.comm``), the GPU sampler (a thread), the watchdog, the deadline watch and
    the callbacks; every one that starts something is undone by ``stack``."""
    from ..health import deadline
    from ..health.gpuutil import GpuSampler
    from ..health.metrics import CommTimer, StepMeter
    from ..health.watchdog import ProgressWatchdog
    from ..trainer import MetricsFileCallback, ScheduleCallback

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
    metrics_path = Path(output_dir) / METRICS_FILE
    if dist.rank == 0:
        callbacks.append(MetricsFileCallback(metrics_path))
    if spec.train.straggler_window:  # after the schedule: its on_step_end has ended the meter's step
        from ..health.metrics import MetricsFile
        from ..health.straggler import StragglerWatch
        from ..trainer import StragglerCallback

        callbacks.append(StragglerCallback(StragglerWatch(
            spec.train.straggler_window, spec.train.straggler_factor, meter, dist.rank, dist.node, dist.requeue_id or dist.job_id,
            dist.executor, output_dir, MetricsFile(metrics_path) if dist.rank == 0 else None)))
    return _Instruments(meter, watchdog, watch, schedule, callbacks, metrics_path)


def _build_trainer(spec: JobSpec, task, cuda: bool, attn: str, model, tok, args, dataset, collator, tools: _Instruments,
                   job: dict[str, Any], params: tuple[int, int], ds_config: dict[str, Any], eval_dataset=None):
    from ..health.metrics import flops_per_token

    trainer = task.trainer(
        spec, cuda, attn, model=model, args=args, train_dataset=dataset, eval_dataset=eval_dataset, data_collator=collator,
        processing_class=tok, callbacks=tools.callbacks, meter=tools.meter, job=job,
        flops_per_token=flops_per_token(*params), cpu_adam=cuda and _offloads_optimizer(ds_config),
    )
    trainer.deadline = tools.deadline
    if spec.train.optimizer != "adamw":
        allow_low_rank_optimizer_state(spec.train.optimizer)
    return trainer


def _zero_stage(ds_config: dict[str, Any]) -> int:
    return int(ds_config.get("zero_optimization", {}).get("stage", 0) or 0)


def _data(spec: JobSpec, args, tok, model, attn: str, output_dir: str, task: str = "sft"):
    """(train dataset, collator): tokenized once into the cache (rank 0 first, the others read it), then
    packed rows (``train.packing``) or single samples padded per micro-batch. ``task``: SFT records, or raw
    text ("pt": ``data.text``)."""
    from ..data.cache import cached_dataset, codec
    from ..data.tokens import Collator

    t = spec.train
    with args.main_process_first(local=False, desc="tokenizing the dataset"):
        samples = cached_dataset(t.dataset, tok, t.max_length, Path(output_dir) / CACHE_DIR, t.dataset_num_proc, task)
    if args.process_index == 0:
        if samples.tokenized_now:
            log.warning("tokenized %d example(s) into %s", len(samples), samples.directory)
        if samples.dropped:
            log.warning("%d example(s) dropped: %s", samples.dropped, codec(task).DROPPED.format(max_length=t.max_length))
    if not t.packing:  # sequence parallel: batches of max_length (a multiple of the degree) with position_ids
        return samples, Collator(tok.pad_token_id, t.max_length if spec.parallel.sequence_parallel > 1 else None)
    from ..data import packing
    from ..kernels import choose as kernels

    packing.prepare_model(model)
    rows = packing.PackedDataset(samples, t.max_length, t.seed)
    return rows, packing.PackingCollator(t.max_length, tok.pad_token_id, flatten=attn.startswith("flash_attention"),
                                         # under SP the kernel reads them from the gathered position_ids instead:
                                         # the Ulysses adapter shards every batch tensor along the sequence
                                         boundaries=attn == kernels.VARLEN and spec.parallel.sequence_parallel == 1)


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
        text = summary(result, output_dir, losses[0] if losses else None)
        print(text, flush=True)
        import json

        body = {**dataclasses.asdict(result), "first_loss": losses[0] if losses else None, "text": text}
        from ...fsutil import atomic_write_text

        atomic_write_text(Path(output_dir) / SUMMARY_FILE, json.dumps(body, indent=2))
    return result


def read_summary(output_dir: str) -> str | None:
    """The end-of-training summary rank 0 wrote (for `submit --wait` to print), or None."""
    from ...fsutil import RECORD_CAP, read_json

    try:
        text = read_json(Path(output_dir) / SUMMARY_FILE, RECORD_CAP).get("text")
    except (OSError, ValueError):  # none, or Unreadable
        return None
    return text if isinstance(text, str) else None


def summary(result: TrainResult, output_dir: str, first_loss: float | None) -> str:
    """The end-of-training lines printed on rank 0."""
    def fmt(x, spec=".4f"):
        return "n/a" if x is None else format(x, spec)

    how = ("stopped for requeue (walltime signal)" if result.stopped_for_requeue
           else "stopped early" if result.stop_reason else "finished")
    lines = [
        f"swiftslurm: training {how} at step {result.global_step} in {result.wall_s:.1f} s",
        f"  loss: first {fmt(first_loss)} -> final {fmt(result.final_loss)}",
        f"  throughput: {fmt(result.useful_tokens_per_s, '.1f')} useful tokens/s (all ranks, padding excluded; "
        f"{result.useful_tokens} of {result.total_tokens} positions, padding {fmt(result.padding_ratio, '.1%')}); "
        f"optimizer {result.optimizer or '?'}",
        f"  kernels: attention {result.attn_implementation or '?'}, Liger {result.liger}, "
        f"packing {'on' if result.packing else 'off'}",
        f"  checkpoints: {output_dir}/checkpoint-<step> (latest: {Path(result.checkpoints[-1]).name if result.checkpoints else 'none'}); "
        f"`swiftslurm verify {output_dir}` checks them",
    ]
    if result.task == "dpo":
        lines.insert(2, f"  reward accuracy (chosen scored above rejected, last logged step): {fmt(result.reward_accuracy, '.3f')}")
    elif result.task == "rm":
        lines.insert(2, f"  reward accuracy (chosen scored above rejected, last logged step): {fmt(result.reward_accuracy, '.3f')}; "
                        f"margin {fmt(result.reward_margin, '.3f')}")
    elif result.task == "kto":
        lines.insert(2, f"  reward margin (desirable minus undesirable, last logged step): {fmt(result.reward_margin, '.3f')}")
    elif result.task == "grpo":
        lines.insert(2, f"  mean reward: first {fmt(result.rewards[0])} -> last {fmt(result.rewards[-1])} (logged steps)")
    if result.stop_reason:
        lines.insert(1, f"  {result.stop_reason}")
    if result.metric_for_best_model:
        best = Path(result.best_checkpoint).name if result.best_checkpoint else "none"
        lines.append(f"  evaluation: last eval_loss {fmt(result.eval_loss)}; best {result.metric_for_best_model} {fmt(result.best_metric)} "
                     f"at step {result.best_step if result.best_step is not None else 'n/a'} ({best}; {output_dir}/latest_best names it)")
    if result.tensorboard_dir:
        lines.append(f"  TensorBoard: tensorboard --logdir {result.tensorboard_dir}")
    if result.metrics_file:
        lines.append(f"  metrics: {result.metrics_file}")
    return "\n".join(lines)
