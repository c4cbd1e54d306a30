"""The HF Trainer subclass and callbacks: verified checkpoint saves, measured metrics, walltime stop.

Saving: the Trainer writes its normal HF/DeepSpeed checkpoint (weights or adapter, DeepSpeed shards,
rng_state_<rank>.pth, scheduler, trainer_state.json) through a link ``<out>/.swiftslurm-save/checkpoint-N``
that points at ``checkpoint.staging_dir(out, N)``; after a barrier rank 0 seals it with
``checkpoint.commit`` (manifest last, rename into ``checkpoint-N``, ``latest``), a barrier, then
``checkpoint.prune(out, keep)`` on rank 0. The Trainer's own rotation is off (save_total_limit None).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as tdist
from transformers import Trainer, TrainerCallback

from .. import checkpoint as ck
from ..checkpoint import savetime
from ..taskdir import SAVE_LINK_DIR
from . import moe
from .collective import all_reduce_values, stop_flag_group
from .health import startup
from .health.gpuutil import gpu_fields, rank_slots
from .health.metrics import MetricsFile, StepMeter
from .save.background import BackgroundSave

log = logging.getLogger("swiftslurm.train")


def _barrier() -> None:
    if tdist.is_available() and tdist.is_initialized():
        tdist.barrier()


def _gather_hashes(own: dict[str, dict]) -> dict[str, dict]:
    """Every rank's ``hash_own_files`` merged on rank 0 (other ranks get {})."""
    if not (tdist.is_available() and tdist.is_initialized()) or tdist.get_world_size() == 1:
        return dict(own)
    parts: list[dict] | None = [{} for _ in range(tdist.get_world_size())] if tdist.get_rank() == 0 else None
    tdist.gather_object(own, parts, dst=0)
    merged: dict[str, dict] = {}
    for part in parts or []:
        merged.update(part or {})
    return merged


def finite_or_mean(loss: torch.Tensor, summed: torch.Tensor, steps_since_log: int) -> torch.Tensor:
    """HF's ``logging_nan_inf_filter`` without reading the loss on the host: an inf/NaN micro-batch loss counts as the
    mean of the losses summed since the last log (``summed / (1 + steps_since_log)``), as the Trainer's loop does."""
    return torch.where(torch.isfinite(loss), loss, summed / (1 + steps_since_log))


@dataclass(frozen=True)
class RunFacts:
    """What the Trainer needs of the spec for its saves and their manifest (``run.train`` builds it once)."""

    name: str  # job.name
    train_type: str  # "lora" | "full"
    checksum: str  # checkpoint.checksum: the manifest's algorithm
    keep: int  # checkpoint.keep
    signal_grace_s: int
    global_batch: int  # samples (or packed rows) per optimizer step
    spec_fingerprint: dict[str, Any]  # checkpoint/fingerprint.py: a resume under another spec warns
    packing: bool
    zero_stage: int
    fused_lora: bool
    sequence_parallel: int = 1
    tensor_parallel: int = 1
    expert: int = 1  # [parallel] expert: AutoEP's degree
    async_save: bool = False  # checkpoint.async_save, resolved: DeepSpeed's shards written in the background
    lora_dropout: float = 0.0  # train.lora_dropout under LoRA (TRL's tasks: an MoE's projections get it back here)


class SwiftTrainer(Trainer):
    """Trainer + swiftslurm's save protocol and measurements. ``job`` carries spec facts for the meta."""

    def __init__(self, *args, meter: StepMeter, job: RunFacts, flops_per_token: float | None = None,
                 cpu_adam: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.cpu_adam = cpu_adam
        self.meter = meter
        self.job = job
        self.flops_per_token = flops_per_token
        self.optimizer_name = ""
        self.save_seconds: list[float] = []
        self.committed: list[str] = []
        self.deadline = None  # a train.deadline.DeadlineWatch: told each save's time, reports deadline_margin_s
        self.saves = BackgroundSave()  # checkpoint.async_save: the save in flight
        self._staged: Any = None  # the save being staged (save_model's weights join it)
        if job.async_save:
            self.add_callback(PinAhead(self))
        experts = moe.expert_counts(self.model.config) if self.model is not None else None
        self.router = moe.RouterLoad(self.model, *experts) if experts else None  # an MoE model's tokens per expert

    def create_optimizer(self, model=None):
        """With ZeRO optimizer offload on GPUs: DeepSpeed's CPU Adam (AdamW mode), the optimizer ZeRO-Offload is
        built for; torch's AdamW stepping on offloaded CPU tensors is several times slower. Falls back to the
        default optimizer, with a warning, when the op cannot be built on this node (no compiler or ninja)."""
        if not self.cpu_adam or self.optimizer is not None:
            optimizer = super().create_optimizer(model)
            kind = type(optimizer)
            package = kind.__module__.split(".")[0]  # galore_torch.AdamW is not torch's AdamW
            self.optimizer_name = kind.__name__ if package == "torch" else f"{package}.{kind.__name__}"
            return optimizer
        opt_model = self.model if model is None else model
        assert opt_model is not None  # the Trainer holds its model before it builds the optimizer
        decay = set(self.get_decay_parameter_names(opt_model))
        groups = [
            {"params": [p for n, p in opt_model.named_parameters() if n in decay and p.requires_grad],
             "weight_decay": self.args.weight_decay},
            {"params": [p for n, p in opt_model.named_parameters() if n not in decay and p.requires_grad],
             "weight_decay": 0.0},
        ]
        try:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            self.optimizer = DeepSpeedCPUAdam(groups, lr=self.args.learning_rate, betas=(self.args.adam_beta1, self.args.adam_beta2),
                                              eps=self.args.adam_epsilon, adamw_mode=True)
        except Exception as exc:  # the op is compiled on first use; a node without a toolchain cannot
            log.warning("DeepSpeedCPUAdam unavailable (%s); using torch AdamW with the offloaded optimizer", exc)
            self.cpu_adam = False
            return self.create_optimizer(model)
        self.optimizer_name = type(self.optimizer).__name__
        return self.optimizer

    # ---- measurements
    def after_trl_init(self) -> None:
        """TRL's trainers apply LoRA (``peft_config``) inside their ``__init__``: their subclasses call this once it
        returned, to count the FLOPs of the model as it is now and (``train.fused_lora``) fuse its LoRA projections,
        as ``run._build_model`` does for SFT and PT."""
        self.count_model_flops()
        assert self.model is not None  # the Trainer's __init__ set it
        moe.restore_dropout(self.model, self.job.lora_dropout)
        if self.job.train_type == "lora" and moe.expert_counts(self.model.config) is not None and self.args.process_index == 0:
            log.warning("mixture of experts, LoRA: %s", moe.adapted(self.model, self.job.lora_dropout))
        if self.job.fused_lora:
            from .kernels import lora

            lora.install(self.model, say=self.args.process_index == 0)

    def count_model_flops(self) -> None:
        """``flops_per_token`` from the model as it is now: TRL's trainers apply LoRA (``peft_config``) inside their
        ``__init__``, after ``run.train`` counted the parameters, so their subclasses call this once it returned."""
        from .health.metrics import flops_per_token

        assert self.model is not None  # the Trainer's __init__ set it
        total = sum(p.numel() for p in self.model.parameters())
        trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        self.flops_per_token = flops_per_token(moe.active_params(self.model, total), trainable)

    # ---- no host sync per step: the grad norm stays a tensor until a logging step reads it
    def _deepspeed_norm(self):
        """The norm DeepSpeed computed in this step, as it holds it (a device tensor, a float, or None): accelerate's
        ``get_global_grad_norm`` and the Trainer's ``_get_grad_norm`` call ``.item()`` on it, a host sync every step
        that keeps the CPU from queueing the next step while the optimizer runs. ``_maybe_log_save_evaluate`` reads
        it (``.item()``) only at logging steps."""
        wrapped = getattr(self.accelerator, "deepspeed_engine_wrapped", None)
        return wrapped.engine.get_global_grad_norm() if wrapped is not None else None

    def _clip_grad_norm(self, model):
        if self.is_deepspeed_enabled:  # DeepSpeed clips inside its step (gradient_clipping): only its norm is wanted
            return self._deepspeed_norm()
        return super()._clip_grad_norm(model)

    def _get_grad_norm(self, model, grad_norm=None):
        if self.is_deepspeed_enabled:
            return grad_norm if grad_norm is not None else self._deepspeed_norm()
        return super()._get_grad_norm(model, grad_norm=grad_norm)

    def training_step(self, model, inputs, num_items_in_batch=None):
        """The Trainer's own step; its loop then adds the loss to the logged sum. The Trainer's ``logging_nan_inf_filter``
        (off in our TrainingArguments) tests each micro-batch's loss on the host for inf/NaN, a sync that waits for the
        backward and the optimizer step; the same filter is applied here on the device (``finite_or_mean``)."""
        loss = super().training_step(model, inputs, num_items_in_batch)
        summed = getattr(self, "_tr_loss", None)
        if not isinstance(summed, torch.Tensor) or not isinstance(loss, torch.Tensor):
            return loss
        return finite_or_mean(loss, summed, self.state.global_step - self._globalstep_last_logged)

    def save_model(self, output_dir=None, _internal_call=False):
        """Under ZeRO-0/1/2 (no AutoTP) every rank holds every weight whole: rank 0 writes the model (a LoRA run: the
        adapter alone) from its own module, tensor by tensor. The Trainer's own path first has accelerate copy the
        whole state dict to host memory on every rank (``clone_tensors_for_torch_save``), then keeps the adapter of
        it: for the 8B LoRA run that is 16 GB per rank, copied to save tens of MB. ZeRO-3 and AutoTP gather through
        DeepSpeed as before (a collective: every rank takes part)."""
        if not self._writes_own_model():
            return super().save_model(output_dir, _internal_call)
        if self.args.should_save:
            out, staged = output_dir or self.args.output_dir or ".", self._staged
            model: Any = self.model
            if staged is not None:
                real = os.path.realpath(out)  # the save goes through a link that is gone when the background writes
                staged.defer(_saved_weights(model), lambda state: self._save(real, state_dict=state), "model weights")
            else:
                self._save(out)
        return None

    def _writes_own_model(self) -> bool:
        """save_model's own path: DeepSpeed without ZeRO-3 or AutoTP (the run's own facts of its DeepSpeed config)."""
        gathers = self.job.zero_stage == 3 or self.job.tensor_parallel > 1
        return self.is_deepspeed_enabled and not gathers and not getattr(self, "is_distributed_loading_by_transformers", False)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Evaluation takes each batch's own mean loss, as one rank computes it. transformers 5 passes evaluation too the
        count of label tokens summed over the ranks and scales the loss by the ranks' number (training's rule, for the
        gradient), so a batch with more tokens than its peers weighs more and the last, padded batch (its duplicate
        dropped by ``gather_for_metrics``) keeps a value scaled for two: 2 ranks reported an eval_loss of 5.70 where
        1 rank and the records' own mean give 5.64 (tests/test_evaluation.py)."""
        if not model.training:
            num_items_in_batch = None
        return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batches = self.take_batches(epoch_iterator, num_batches)
        return batches, self._get_num_items_in_batch(batches, device)

    def take_batches(self, epoch_iterator, num_batches: int) -> list:
        """This step's batches (up to ``num_batches``), each counted with the wait for it by ``count_batch``."""
        self.meter.begin_step()
        batches = []
        for _ in range(num_batches):
            start = time.perf_counter()
            try:
                batch = next(epoch_iterator)
            except StopIteration:
                break
            self.count_batch(batch, time.perf_counter() - start)
            batches.append(batch)
        return batches

    def count_batch(self, batch, wait_s: float) -> None:
        self.meter.add_batch(batch, wait_s)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs:  # a training-step log: add the measured values (one all-reduce, every rank)
            self.meter.settle()
            own = self.meter.gpu.take() if self.meter.gpu is not None else None
            slots = rank_slots(own, self.args.process_index, self.args.world_size)  # every rank's value, each in its slot
            routed = self.router.counts() if self.router is not None else []
            tokens, samples, total, *rest = all_reduce_values([self.meter.tokens, self.meter.samples, self.meter.total_tokens,
                                                               *slots, *routed], tdist.ReduceOp.SUM, self.args.device)
            utils, routed = rest[:len(slots)], rest[len(slots):]
            # the ranks of a TP group train on copies of one batch; SP ranks on shards of the same samples
            tp, sp = self.job.tensor_parallel, self.job.sequence_parallel
            tokens, total, samples = tokens / tp, total / tp, samples / (tp * sp)
            logs.update(self.meter.summary(int(tokens), int(samples), self.flops_per_token, self.args.world_size, int(total)))
            logs.update(gpu_fields(utils))
            if self.router is not None:
                logs.update(self.router.summary(routed))
        super().log(logs, start_time)
        if "loss" in logs:  # a background save that finished since: its figures on a line of their own
            self._log_finished_saves()

    # ---- verified checkpoints
    def _output_dir(self) -> str:
        out = self.args.output_dir
        if out is None:  # build.training_arguments always sets it
            raise ValueError("TrainingArguments.output_dir is not set")
        return out

    def _get_output_dir(self, trial) -> str:
        return os.path.join(self._output_dir(), SAVE_LINK_DIR)

    def _save_checkpoint(self, model, trial) -> None:
        """One verified save (docs/checkpoints.md). With ``checkpoint.async_save`` the DeepSpeed shards are copied to
        host memory here and written, hashed and committed by a background thread (``save.background``), while
        training goes on; a save that ends the run (walltime, deadline, early stop, the last step) is waited for, so
        the stop report follows its commit. Either way one save at a time: this one first waits for the last."""
        start = time.perf_counter()
        waited = self.saves.wait()  # the previous background save, committed
        self._log_finished_saves()
        out, step = self._output_dir(), self.state.global_step
        link = Path(out) / SAVE_LINK_DIR / f"checkpoint-{step}"
        staging = ck.staging_dir(out, step)
        if self.args.process_index == 0:
            ck.prepare_staging(out, step)
            link.parent.mkdir(parents=True, exist_ok=True)
            if link.is_symlink() or link.exists():
                link.unlink()
            os.symlink(os.path.relpath(staging, link.parent), link)
        _barrier()
        staged = self._stage_writes() if self.job.async_save and not self._run_ends_here() else None
        self._staged = staged  # save_model defers the model's weights to it
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._staged = None
            if staged is not None:
                engine: Any = self.model_wrapped
                engine.checkpoint_engine = staged.wrapped
        _barrier()
        if self.args.process_index == 0:
            link.unlink()
            try:
                link.parent.rmdir()
            except OSError:
                pass
        meta, best = self._save_meta(step), self._best_step()
        if staged is not None:
            stall = time.perf_counter() - start
            ck.crash_point("snapshot", step)  # the state copied off the training's path, nothing of it written yet
            self.saves.submit(lambda: self._finish_in_background(staged, staging, step, meta, best, start, stall))
            self.log({"checkpoint_stall_s": stall, "checkpoint_copy_s": staged.copy_s, "checkpoint_wait_s": waited,
                      "checkpoint_staged_mb": staged.nbytes / 2**20})
            return
        phases: dict[str, float] = {"write": time.perf_counter() - start - waited, **({"wait": waited} if waited else {})}
        # every rank hashes the files it wrote, in parallel; rank 0 hashes the shared ones in commit and merges
        t_hash = time.perf_counter()
        rank = self.args.process_index
        own = ck.hash_own_files(staging, rank, self.job.checksum) if rank != 0 else {}
        phases["hash"] = time.perf_counter() - t_hash
        hashes = _gather_hashes(own)
        if rank == 0:
            self._commit(staging, step, meta, hashes, phases)
        _barrier()
        if rank == 0:
            self._prune(best, phases)
        seconds = time.perf_counter() - start
        self.log({"checkpoint_save_s": seconds, "checkpoint_stall_s": seconds, **self._account(step, seconds, phases, seconds)})

    def _run_ends_here(self) -> bool:
        """This save is the run's last (a walltime or deadline stop, early stopping, the last step): it is waited for."""
        return bool(self.control.should_training_stop) or self.state.global_step >= self.state.max_steps

    def _stage_writes(self):
        """Swap the DeepSpeed engine's checkpoint engine for one that snapshots each file (``save.snapshot``); None
        (a synchronous save) where the engine is not DeepSpeed's plain ``torch.save`` one."""
        from .save.snapshot import StagedWrites

        wrapped: Any = self.model_wrapped
        if not _saves_with_torch(wrapped):
            return None
        staged = StagedWrites(wrapped.checkpoint_engine)
        wrapped.checkpoint_engine = staged
        return staged

    def pin_ahead(self) -> None:
        """``checkpoint.async_save`` on a GPU, after this run's first optimizer step: learn the sizes of the storages a
        save copies (DeepSpeed's own save through ``save.snapshot.SizeProbe``, which writes no checkpoint file) and pin
        host buffers of those sizes in the background (about 1.2 GB/s; the first save waits for what is left), so the
        first save's copy runs at the bus's speed too."""
        from .save.snapshot import SizeProbe, gpu_storage_sizes, prepare

        engine: Any = self.model_wrapped
        if not torch.cuda.is_available() or not _saves_with_torch(engine):
            return
        probe = SizeProbe(engine.checkpoint_engine)
        scratch = tempfile.mkdtemp(prefix=".size-probe-", dir=self._output_dir())
        engine.checkpoint_engine = probe
        try:  # the Trainer's own call (exclude_frozen_parameters for a PEFT model), into a scratch dir of ours
            engine.save_checkpoint(scratch, tag="size-probe", save_latest=False,
                                   **({"exclude_frozen_parameters": True} if hasattr(self.model, "peft_config") else {}))
        finally:
            engine.checkpoint_engine = probe.wrapped
            shutil.rmtree(scratch, ignore_errors=True)
        sizes = probe.sizes
        if self.args.should_save and self._writes_own_model():
            sizes += gpu_storage_sizes(_saved_weights(engine.module))  # what save_model defers (model.safetensors, the adapter)
        self.saves.submit(lambda: {"checkpoint_pin_s": prepare(sizes), "checkpoint_pinned_mb": sum(sizes) / 2**20},
                          name="swiftslurm-pin")

    def _finish_in_background(self, staged, staging: Path, step: int, meta: dict, best: int | None, start: float,
                              stall: float) -> dict:
        """The background half: write the snapshots, hash this rank's files and hand them to rank 0, which waits for
        every rank's, commits and prunes. Returns the figures to log (the training thread logs them)."""
        t0 = time.perf_counter()
        try:
            staged.write_all(lambda: ck.crash_point("writing", step))  # after the first file: a half-written staging dir
        finally:
            staged.drop()
        ck.crash_point("written", step)  # every file written, none hashed
        phases: dict[str, float] = {"write": time.perf_counter() - t0}
        t_hash = time.perf_counter()
        rank = self.args.process_index
        if rank != 0:
            ck.publish_rank_hashes(staging, rank, ck.hash_own_files(staging, rank, self.job.checksum))
        phases["hash"] = time.perf_counter() - t_hash
        if rank == 0:
            hashes = ck.collect_rank_hashes(staging, self.args.world_size, timeout_s=float(self.args.ddp_timeout))
            self._commit(staging, step, meta, hashes, phases)
            self._prune(best, phases)
        seconds = time.perf_counter() - start
        pinned = {"checkpoint_pin_s": pin} if (pin := staged.prepare_next()) else {}  # the next save's buffers
        return {"checkpoint_save_s": seconds, "checkpoint_step": step, **self._account(step, seconds, phases, stall), **pinned}

    def _save_meta(self, step: int) -> dict[str, Any]:
        return {"step": step, "world_size": self.args.world_size, "seed": self.args.seed,
                "data_position": {"epoch": self.state.epoch,
                                  ("packed_rows" if self.job.packing else "samples"): step * self.job.global_batch},
                "job_name": self.job.name, "train_type": self.job.train_type,
                "spec_fingerprint": self.job.spec_fingerprint,
                "parallel": {"sequence_parallel": self.job.sequence_parallel,
                             "tensor_parallel": self.job.tensor_parallel, "expert": self.job.expert},
                "dp_world_size": self.args.world_size, "zero_stage": self.job.zero_stage}  # universal.writer_layout

    def _best_step(self) -> int | None:
        """The best evaluation's step, as of this save (its pointer is set once this save is committed)."""
        return self.state.best_global_step if self.args.metric_for_best_model else None

    def _commit(self, staging: Path, step: int, meta: dict, hashes: dict, phases: dict[str, float]) -> None:
        """Rank 0: seal the staging dir as ``checkpoint-<step>``."""
        final = ck.final_dir(self._output_dir(), step)
        meta = {**meta, "hashed_on_ranks": len(hashes)}  # files whose hash a rank other than 0 computed
        ck.commit(staging, final, algo=self.job.checksum, meta=meta, hashes=hashes, timings=phases)
        self.committed.append(str(final))

    def _prune(self, best: int | None, phases: dict[str, float]) -> None:
        """Rank 0, after a commit: the best checkpoint's pointer, then retention."""
        out = self._output_dir()
        if best is not None:  # the best evaluation's checkpoint, before retention sees the dir
            ck.point_best(out, best)
        t_prune = time.perf_counter()
        for path in ck.prune(out, self.job.keep):
            log.info("pruned old checkpoint %s", path)
        phases["prune"] = time.perf_counter() - t_prune

    def _account(self, step: int, seconds: float, phases: dict[str, float], stall: float) -> dict[str, float]:
        """A committed save's figures: kept for the summary and the deadline, recorded with the training's stall
        (rank 0: checkpoint-save.json, which doctor reads), returned to log."""
        self.save_seconds.append(seconds)
        margin: dict[str, float] = {}
        if self.deadline is not None:
            self.deadline.saved(seconds)
            left = self.deadline.margin_s()
            if left is not None:  # rank 0 of a Slurm job: seconds left after this save
                margin["deadline_margin_s"] = left
        if self.args.process_index == 0:
            self._check_grace(step, seconds, {**phases, "stall": stall})
        return {**{f"checkpoint_{k}_s": v for k, v in phases.items()}, **margin}

    def _log_finished_saves(self) -> None:
        for figures in self.saves.take_done():
            self.log(figures)

    def finish_saves(self) -> None:
        """After training: the save in flight (none where the run's last save was waited for) is committed."""
        self.saves.wait()
        self._log_finished_saves()

    def _check_grace(self, step: int, save_s: float, phases: dict[str, float]) -> None:
        """Record this save's phases (checkpoint-save.json) and warn when a walltime save would not fit
        slurm.signal_grace_s after one step, with the value to set."""
        record = savetime.record_save(self._output_dir(), step, save_s, phases, self.meter.last_step_s, self.job.signal_grace_s)
        if record["advice"]:
            log.warning("%s", record["advice"])


def decoder_layers(model) -> list[Any]:
    """The model's repeated decoder layers, in order: the modules transformers' activation checkpointing flags, in its
    language model (a vision-language model's vision tower has such layers too; ``gradient_checkpointing_layers``
    counts the language model's)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    get_decoder = getattr(model, "get_decoder", None)
    root = (get_decoder() if callable(get_decoder) else None) or model
    return [m for m in root.modules() if isinstance(m, GradientCheckpointingLayer)]


class PinAhead(TrainerCallback):
    """Once, after the run's first optimizer step: ``SwiftTrainer.pin_ahead``."""

    def __init__(self, trainer: SwiftTrainer) -> None:
        self.trainer, self.done = trainer, False

    def on_step_end(self, args, state, control, **kwargs):
        if not self.done:
            self.done = True
            self.trainer.pin_ahead()


class RecomputeFirstLayers(TrainerCallback):
    """``train.gradient_checkpointing_layers = k``: of the layers the Trainer enabled for checkpointing (every one,
    before ``on_train_begin``), only the first ``k`` recompute their activations in the backward; the others keep
    them (the memory ``plan`` sized for k)."""

    def __init__(self, layers: int) -> None:
        self.layers = layers

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        for index, layer in enumerate(decoder_layers(model) if model is not None else []):
            if index >= self.layers:
                layer.gradient_checkpointing = False


class StoppedBeforeFirstStep(Exception):
    """The walltime signal came while the run was loading (model, engine, checkpoint): every rank raises it from
    ``on_train_begin``, before a step, and the trainer stops for requeue with no new checkpoint to save."""


class ScheduleCallback(TrainerCallback):
    """Forced saves at fractions of max_steps and at the last step, plus the walltime stop.

    The stop flag is all-reduced with MAX every step, so every rank stops at the same step even when
    only one of them saw the signal (on a gloo group when the default one is NCCL: ``stop_flag_group``).
    On a stop: save now, then stop training.
    """

    def __init__(self, should_stop: Callable[[], bool], fractions: list[float], meter: StepMeter, watchdog: Any = None,
                 deadline=None):
        self.should_stop = should_stop
        self.deadline = deadline  # a train.deadline.DeadlineWatch: stop before the signal when a save would not fit
        self.fractions = fractions
        self.meter = meter
        self.watchdog = watchdog  # a watchdog.ProgressWatchdog: re-armed at every step end
        self.stopped_for_requeue = False
        self.forced: set[int] = set()
        self.flag_group = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.forced = {max(1, round(f * state.max_steps)) for f in self.fractions} | {state.max_steps}
        self.flag_group = stop_flag_group(timeout_s=args.ddp_timeout)
        from .kernels.overflow import kept_reason, norm_in_one_pass, skip_nonfinite_on_device
        from .resume.worldsize import untie_step_counters

        # after any checkpoint load, before the first step: a ZeRO-3 universal load shares one step counter
        untied = untie_step_counters(kwargs.get("optimizer"))
        if untied:
            log.info("gave %d optimizer sub-groups their own step counter (DeepSpeed's ZeRO-3 universal load shares one)", untied)
        optimizer = kwargs.get("optimizer")
        if skip_nonfinite_on_device(optimizer) and state.is_world_process_zero:  # ZeRO-1/2 bf16 (overflow.py)
            log.warning("deepspeed: a step whose gradient norm is inf/NaN is skipped on the device by fused AdamW "
                        "(DeepSpeed's per-step inf/NaN check and its host syncs are off)")
        elif state.is_world_process_zero and (kept := kept_reason(optimizer)):  # the reason is rank 0's to say
            log.warning("deepspeed: its bf16 inf/NaN check stays on (two host syncs per optimizer step): %s", kept)
        if norm_in_one_pass(optimizer) and state.is_world_process_zero:  # ZeRO-1/2 (overflow.py)
            log.info("deepspeed: the gradient norm is taken in one multi-tensor pass (torch._foreach_norm)")
        # USR2 while loading: the first step's end may come after the time limit (a big model, a slow filesystem), so
        # stop now, agreed by all ranks; the newest verified checkpoint is still the resume point, nothing to save
        (flag,) = all_reduce_values([1.0 if self.should_stop() else 0.0], tdist.ReduceOp.MAX, args.device)
        startup.done()  # every rank got here: the start is over, the progress watchdog takes over from its warm-up
        if flag > 0:
            self.stopped_for_requeue = True
            log.warning("walltime stop before the first step of this run (the signal came while loading): stopping for "
                        "requeue at step %d, nothing new to save", state.global_step)
            raise StoppedBeforeFirstStep()

    def on_step_end(self, args, state, control, **kwargs):
        self.meter.end_step()
        if self.watchdog is not None:
            self.watchdog.step_done(state.global_step)
        saving = control.should_save or state.global_step in self.forced
        stop = self.should_stop() or (self.deadline is not None and self.deadline.due(saving))
        (flag,) = all_reduce_values([1.0 if stop else 0.0], tdist.ReduceOp.MAX, args.device, args.world_size, self.flag_group)
        if flag > 0:
            self.stopped_for_requeue = True
            control.should_save = True
            control.should_training_stop = True
            log.warning("walltime stop: saving at step %d, then stopping for requeue", state.global_step)
        elif state.global_step in self.forced:
            control.should_save = True
        self._pause_for_what_follows(control)
        return control

    def on_epoch_end(self, args, state, control, **kwargs):
        self._pause_for_what_follows(control)  # an epoch's evaluation and save (eval_strategy/save_strategy "epoch")
        return control

    def _pause_for_what_follows(self, control) -> None:
        """A save or an evaluation follows (and the saves an evaluation asks for, the best checkpoint's, early
        stopping's): none of them is a stalled step, and any may take longer than the limit. The next step end
        re-arms the watchdog."""
        if (control.should_save or control.should_evaluate) and self.watchdog is not None:
            self.watchdog.pause()


class MetricsFileCallback(TrainerCallback):
    """Writes metrics.jsonl on rank 0 for every log call."""

    def __init__(self, path: str | Path) -> None:
        self.file = MetricsFile(path)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            self.file.write(state.global_step, logs)


class StragglerCallback(TrainerCallback):
    """The straggler watch (health/straggler.py) at the step boundaries; after ScheduleCallback, which ends the meter's step."""

    def __init__(self, watch: Any) -> None:
        self.watch = watch

    def on_step_begin(self, args, state, control, **kwargs):
        self.watch.step_begin()

    def on_step_end(self, args, state, control, **kwargs):
        self.watch.step_end(state.global_step, args.device)


def _saves_with_torch(engine) -> bool:
    """The DeepSpeed engine saves through its plain ``torch.save`` checkpoint engine (not the decoupled, fast or Nebula
    ones): the one whose files ``save.snapshot`` can copy and write later, byte for byte."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    return type(getattr(engine, "checkpoint_engine", None)) is TorchCheckpointEngine


def _saved_weights(model) -> dict[str, Any]:
    """What ``save_model`` writes of ``model``: its state dict, or an adapter's trainable tensors only (peft's save keeps
    the adapter's keys of the state it is given; the whole state would copy the frozen base to host memory)."""
    if hasattr(model, "peft_config"):
        return {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}
    return model.state_dict()
