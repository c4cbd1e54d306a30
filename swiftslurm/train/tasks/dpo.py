"""Preference training (``train.task = "dpo"``) through TRL's ``DPOTrainer``, behind ``sft.train``'s task seam.

Everything the SFT trainer owns stays shared: resume agreement, verified checkpoints, the walltime stop,
measured metrics, metrics.jsonl and the summary (``sft.train``, ``trainer.SFTTrainer``). This module adds:

- the arguments: TRL's ``DPOConfig`` = the SFT ``TrainingArguments`` keys + beta, loss type,
  ``precompute_ref_log_probs``, ``max_length``;
- the data: ``preference.load`` (checked prompt/chosen/rejected records); TRL tokenizes them and its
  ``DataCollatorForPreference`` pads them; ``max_prompt_length`` keeps the prompt's last tokens;
- the reference model: LoRA hands TRL the base model and the LoRA config, so TRL scores the reference
  with the adapter disabled (no second copy); full fine-tuning loads a second copy of the model
  (under ZeRO-3 TRL shards it with the same config), or none with ``precompute_ref_log_probs``;
- the metrics: TRL's rewards/chosen, rewards/rejected, rewards/margins, rewards/accuracies, logged by
  the same ``log`` that feeds TensorBoard and metrics.jsonl.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...taskdir import PREFERENCE_CACHE_DIR as CACHE_DIR  # under output_dir: the Arrow data, TRL's tokens and reference log-probs

if TYPE_CHECKING:
    from ...spec.model import JobSpec

log = logging.getLogger("swiftslurm.train")


def dpo_arguments(spec: JobSpec, output_dir: str, ds_config: dict[str, Any], cuda: bool, liger: dict[str, bool] | None):
    from trl import DPOConfig

    from ..build import training_kwargs

    t = spec.train
    return DPOConfig(
        **training_kwargs(spec, output_dir, ds_config, cuda, liger),
        beta=t.dpo_beta,
        loss_type=[t.dpo_loss_type],
        precompute_ref_log_probs=t.precompute_ref_log_probs,
        max_length=t.max_length,
        dataset_num_proc=t.dataset_num_proc if t.dataset_num_proc > 1 else None,
    )


def trainer_class():
    """``SwiftDPOTrainer``: our Trainer plumbing (``SFTTrainer``) in front of TRL's ``DPOTrainer`` in the MRO, so
    our ``log``/``_save_checkpoint``/``get_batch_samples`` wrap TRL's, which wrap ``transformers.Trainer``'s."""
    from trl import DPOTrainer

    from ..trainer import SFTTrainer

    class SwiftDPOTrainer(SFTTrainer, DPOTrainer):
        def __init__(self, *args, max_prompt_length: int | None = None, **kwargs):
            self.max_prompt_length = max_prompt_length  # read by _prepare_dataset, inside TRL's __init__
            super().__init__(*args, **kwargs)
            self.count_model_flops()  # TRL applied LoRA (peft_config) inside __init__

        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
            dataset = super()._prepare_dataset(dataset, processing_class, args, dataset_name)
            keep = self.max_prompt_length
            if keep is None:
                return dataset
            # a long prompt keeps its end: the part next to the answer being judged
            return dataset.map(lambda ex: {"prompt_ids": ex["prompt_ids"][-keep:]}, desc="max_prompt_length")

    return SwiftDPOTrainer


class DPOTask:
    """``sft.train``'s task seam for DPO (``sft.SFTTask`` is the other one)."""

    name = "dpo"

    def arguments(self, spec: JobSpec, output_dir: str, ds_config: dict[str, Any], cuda: bool, liger: dict[str, bool] | None, parallelism_config=None):
        return dpo_arguments(spec, output_dir, ds_config, cuda, liger)  # [parallel] with DPO is refused at validate

    def prepare_model(self, model, spec: JobSpec):
        return model  # LoRA: TRL wraps it from peft_config, and then disables the adapter for the reference

    def data(self, spec: JobSpec, args, tok, model, attn: str, output_dir: str):
        from ..data import preference
        from ..data.tokens import ensure_chat_template

        ensure_chat_template(tok)
        with args.main_process_first(local=False, desc="reading the preference data"):
            dataset = preference.load(list(spec.train.dataset), Path(output_dir) / CACHE_DIR)
        return dataset, None  # TRL's DataCollatorForPreference

    def describe_data(self, spec: JobSpec, dataset) -> str:
        return f"off (DPO: {len(dataset)} preference pairs, each micro-batch padded to its longest sequence)"

    def trainer(self, spec: JobSpec, cuda: bool, attn: str, **kwargs):
        from ..build import load_model_and_tokenizer, lora_config

        t = spec.train
        ref_model, peft_config = None, None
        if t.train_type == "lora":
            peft_config = lora_config(t)
        elif not t.precompute_ref_log_probs:
            # a second copy of the starting weights (the same seed rebuilds tiny-llama's); under ZeRO-3 it is loaded
            # partitioned, as the policy was, and TRL's prepare_deepspeed shards it with the same config
            ref_model, _ = load_model_and_tokenizer(spec, cuda, attn)
        kwargs.pop("data_collator", None)
        return trainer_class()(ref_model=ref_model, peft_config=peft_config, max_prompt_length=t.max_prompt_length, **kwargs)
