"""Online RL (``train.task = "grpo"``) through TRL's ``GRPOTrainer``, behind ``run.train``'s task seam.

Everything the run owns (``run.py``) stays shared: resume agreement, verified checkpoints, the walltime stop,
measured metrics, metrics.jsonl and the summary (``run.train``, ``trainer.SwiftTrainer``). This module adds:

- the arguments: TRL's ``GRPOConfig`` = the SFT ``TrainingArguments`` keys + ``num_generations``,
  ``max_completion_length``, ``temperature``, ``beta`` (``train.grpo_beta``), ``reward_weights``; generation by
  the model itself on every rank (HF ``generate``), or vLLM in TRL's colocate mode (``train.use_vllm``: refused
  here, before the model loads, on a node without vLLM or a GPU);
- the data: ``prompts.load`` (checked prompts and the columns the reward functions read);
- the rewards: ``rewards.resolve`` (built-ins, ``file.py:function``, ``module:function``), each ``Guarded``: a
  function that raises is named with its sample on every rank, which all stop at one collective with
  ``RewardFailed`` (exit code 70) instead of leaving the others waiting;
- the reference model: none at ``grpo_beta = 0``; LoRA scores it with the adapter disabled; full fine-tuning
  lets TRL load a second copy from the model's path;
- the metrics: TRL's ``reward``, ``reward_std``, ``rewards/<function>/mean``, ``completions/mean_length``,
  ``kl`` (with ``grpo_beta > 0``), logged by the same ``log`` that feeds TensorBoard and metrics.jsonl; tokens
  counted from the generated batch (prompt and completion tokens, padding apart).
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import SwiftSlurmError
from ...taskdir import PROMPT_CACHE_DIR as CACHE_DIR  # the Arrow copy of the prompts, under output_dir

if TYPE_CHECKING:
    from ...spec.model import JobSpec

log = logging.getLogger("swiftslurm.train")


class GenerationUnavailable(SwiftSlurmError):
    exit_code = 2


def check_vllm(use_vllm: bool, cuda: bool, installed: bool | None = None) -> None:
    """``train.use_vllm`` can run on this node: vLLM is installed and there is a GPU for its colocated engine."""
    if not use_vllm:
        return
    if installed is None:
        installed = importlib.util.find_spec("vllm") is not None
    if not installed:
        raise GenerationUnavailable("train.use_vllm = true needs vLLM on the nodes", "the vllm package is not installed "
                                    "in the ranks' Python", "pip install vllm in the job's environment (a version TRL "
                                    "supports), or set use_vllm = false: the model generates with HF generate on each rank")
    if not cuda:
        raise GenerationUnavailable("train.use_vllm = true needs a GPU on every rank", "no CUDA device on this node",
                                    "set use_vllm = false on CPU nodes")


def grpo_arguments(spec: JobSpec, output_dir: str, ds_config: dict[str, Any], cuda: bool):
    from trl import GRPOConfig

    from ..build import training_kwargs

    t = spec.train
    check_vllm(t.use_vllm, cuda)
    return GRPOConfig(
        **training_kwargs(spec, output_dir, ds_config, cuda, None),
        num_generations=t.num_generations,
        max_completion_length=t.max_completion_length,
        temperature=t.temperature,
        beta=t.grpo_beta,
        reward_weights=list(t.reward_weights) if t.reward_weights is not None else None,
        use_vllm=t.use_vllm,
        vllm_mode="colocate",
        log_completions=False,
    )


def trainer_class():
    """``SwiftGRPOTrainer``: our Trainer plumbing (``SwiftTrainer``) in front of TRL's ``GRPOTrainer`` in the MRO."""
    import torch
    from trl import GRPOTrainer

    from ..trainer import SwiftTrainer
    from . import rewards

    class SwiftGRPOTrainer(SwiftTrainer, GRPOTrainer):
        def __init__(self, *args, reward_failures: list, **kwargs):
            self.reward_failures = reward_failures  # filled by the Guarded reward functions of this rank
            super().__init__(*args, **kwargs)
            self.after_trl_init()  # TRL applied LoRA (peft_config) inside __init__: count, fuse

        def get_batch_samples(self, epoch_iterator, num_batches, device):
            """Prompts, not token tensors: counted as samples here; their tokens once generated (below)."""
            return self.take_batches(epoch_iterator, num_batches), None

        def count_batch(self, batch, wait_s: float) -> None:
            self.meter.data_s += wait_s
            self.meter.samples += len(batch)

        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            masks = [out[k] for k in ("prompt_mask", "completion_mask") if isinstance(out.get(k), torch.Tensor)]
            for m in masks:  # summed on the device where they are there, read at the next log (StepMeter.count)
                self.meter.count("tokens", m)
            self.meter.total_tokens += int(sum(m.numel() for m in masks))
            return out

        def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
            self.reward_failures.clear()
            scored = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
            failure = rewards.agree_on_failure(self.reward_failures, self.accelerator.device)
            if failure is not None:
                if self.args.process_index == 0:
                    log.error("stopping: %s (%s)", failure.message(), failure.sample)
                raise rewards.failed_error(failure)  # on every rank: run.train leaves the process groups together
            return scored

    return SwiftGRPOTrainer


class GRPOTask:
    """``run.train``'s task seam for GRPO (``sft.SFTTask`` and ``dpo.DPOTask`` are the others)."""

    name = "grpo"

    def arguments(self, spec: JobSpec, output_dir: str, ds_config: dict[str, Any], cuda: bool, liger: dict[str, bool] | None, parallelism_config=None):
        return grpo_arguments(spec, output_dir, ds_config, cuda)  # [parallel] with GRPO is refused at validate

    def prepare_model(self, model, spec: JobSpec):
        return model  # LoRA: TRL wraps it from peft_config, and disables the adapter for the reference

    def data(self, spec: JobSpec, args, tok, model, attn: str, output_dir: str):
        from ..data import prompts
        from ..data.tokens import ensure_chat_template

        ensure_chat_template(tok)
        tok.padding_side = "left"  # generation continues each prompt from its last token
        need = ("solution",) if "accuracy" in spec.train.reward_funcs else ()
        with args.main_process_first(local=False, desc="reading the prompts"):
            dataset = prompts.load(list(spec.train.dataset), Path(output_dir) / CACHE_DIR, need)
        return dataset, None

    def describe_data(self, spec: JobSpec, dataset) -> str:
        t = spec.train
        return (f"off (GRPO: {len(dataset)} prompts, {t.num_generations} completions of at most "
                f"{t.max_completion_length} tokens each, generated by {'vLLM' if t.use_vllm else 'the model'})")

    def trainer(self, spec: JobSpec, cuda: bool, attn: str, **kwargs):
        from ..build import lora_config
        from . import rewards

        t = spec.train
        failures: list = []
        funcs = rewards.guard(rewards.resolve(t), kwargs["args"].process_index, failures)
        kwargs.pop("data_collator", None)
        peft_config = lora_config(t, model=kwargs.get("model")) if t.train_type == "lora" else None
        return trainer_class()(reward_funcs=funcs, peft_config=peft_config, reward_failures=failures, **kwargs)
