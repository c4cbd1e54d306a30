"""Preference training (``train.task = "dpo"``) through TRL's ``DPOTrainer``, behind ``run.train``'s task seam.

Everything the run owns (``run.py``) stays shared: resume agreement, verified checkpoints, the walltime stop,
measured metrics, metrics.jsonl and the summary (``run.train``, ``trainer.SwiftTrainer``). This module adds:

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
from typing import TYPE_CHECKING, Any

from .trl_task import TRLTask, reference_and_adapter

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
    """``SwiftDPOTrainer``: our Trainer plumbing (``SwiftTrainer``) in front of TRL's ``DPOTrainer`` in the MRO, so
    our ``log``/``_save_checkpoint``/``get_batch_samples`` wrap TRL's, which wrap ``transformers.Trainer``'s."""
    from trl import DPOTrainer

    from ..trainer import SwiftTrainer

    class SwiftDPOTrainer(SwiftTrainer, DPOTrainer):
        def __init__(self, *args, max_prompt_length: int | None = None, **kwargs):
            self.max_prompt_length = max_prompt_length  # read by _prepare_dataset, inside TRL's __init__
            super().__init__(*args, **kwargs)
            self.after_trl_init()  # TRL applied LoRA (peft_config) inside __init__: count, fuse

        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
            dataset = super()._prepare_dataset(dataset, processing_class, args, dataset_name)
            keep = self.max_prompt_length
            if keep is None:
                return dataset
            # a long prompt keeps its end: the part next to the answer being judged
            return dataset.map(lambda ex: {"prompt_ids": ex["prompt_ids"][-keep:]}, desc="max_prompt_length")

    return SwiftDPOTrainer


class DPOTask(TRLTask):
    """``run.train``'s task seam for DPO (``sft.SFTTask`` is the other one)."""

    name = "dpo"

    def arguments(self, spec: JobSpec, output_dir: str, ds_config: dict[str, Any], cuda: bool, liger: dict[str, bool] | None, parallelism_config=None):
        return dpo_arguments(spec, output_dir, ds_config, cuda, liger)  # [parallel] with DPO is refused at validate

    def describe_data(self, spec: JobSpec, dataset) -> str:
        return f"off (DPO: {len(dataset)} preference pairs, each micro-batch padded to its longest sequence)"

    def trainer(self, spec: JobSpec, cuda: bool, attn: str, **kwargs):
        from ..vision import is_multimodal

        ref_model, peft_config = reference_and_adapter(spec, cuda, attn, kwargs.get("model"))
        kwargs.pop("data_collator", None)  # TRL's own, or for a vision-language model ours in front of TRL's
        dataset = kwargs.get("train_dataset")
        if is_multimodal(kwargs.get("processing_class")) and "images" in (getattr(dataset, "column_names", None) or ()):
            from ..data.vision import preference_collator
            from ..vision import VisionUnsupported, image_pair_problem

            problem = image_pair_problem(spec.train)
            if problem:
                raise VisionUnsupported(problem, f"train.model = {spec.train.model!r}, task = \"dpo\"",
                                        "drop those keys for this dataset")
            kwargs["data_collator"] = preference_collator(kwargs["processing_class"], spec.train)
        return trainer_class()(ref_model=ref_model, peft_config=peft_config, max_prompt_length=spec.train.max_prompt_length, **kwargs)
