"""KTO (``train.task = "kto"``) through TRL's ``KTOTrainer``, behind ``run.train``'s task seam.

Everything the run owns (``run.py``) stays shared: resume agreement, verified checkpoints, the walltime stop,
measured metrics, metrics.jsonl and the summary (``run.train``, ``trainer.SwiftTrainer``). This module adds:

- the arguments: TRL's ``KTOConfig`` = the SFT ``TrainingArguments`` keys + ``beta`` (``train.dpo_beta``: the same
  pull towards the reference as DPO's), ``desirable_weight``/``undesirable_weight`` (``train.kto_*_weight``),
  ``precompute_ref_log_probs`` and ``max_length``; TRL's sequential sampling (its KL term pairs each completion with
  the other prompts of its micro-batch, so the order is part of the loss: a resume replays it exactly);
- the data: ``unpaired.load`` (checked prompt/completion/label records); TRL tokenizes them and pads each micro-batch;
- the reference model: as DPO's (``dpo.DPOTask``): LoRA scores it with the adapter disabled, full fine-tuning loads a
  second copy (none with ``precompute_ref_log_probs``);
- the metrics: TRL's rewards/chosen, rewards/rejected, rewards/margins (desirable minus undesirable reward), kl,
  logps/*, logged by the same ``log`` that feeds TensorBoard and metrics.jsonl.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .trl_task import TRLTask, reference_and_adapter

if TYPE_CHECKING:
    from ...spec.model import JobSpec


def kto_arguments(spec: JobSpec, output_dir: str, ds_config: dict[str, Any], cuda: bool, liger: dict[str, bool] | None):
    from trl import KTOConfig

    from ..build import training_kwargs

    t = spec.train
    return KTOConfig(
        **training_kwargs(spec, output_dir, ds_config, cuda, liger),
        beta=t.dpo_beta,
        desirable_weight=t.kto_desirable_weight,
        undesirable_weight=t.kto_undesirable_weight,
        precompute_ref_log_probs=t.precompute_ref_log_probs,
        max_length=t.max_length,
        dataset_num_proc=t.dataset_num_proc if t.dataset_num_proc > 1 else None,
    )


def trainer_class():
    """``SwiftKTOTrainer``: our Trainer plumbing (``SwiftTrainer``) in front of TRL's ``KTOTrainer`` in the MRO."""
    from trl import KTOTrainer

    from ..trainer import SwiftTrainer

    class SwiftKTOTrainer(SwiftTrainer, KTOTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.after_trl_init()  # TRL applied LoRA (peft_config) inside __init__: count, fuse

    return SwiftKTOTrainer


class KTOTask(TRLTask):
    """``run.train``'s task seam for KTO (``sft.SFTTask`` and ``dpo.DPOTask`` are others)."""

    name = "kto"
    records = "unpaired"
    reading = "reading the KTO data"

    def arguments(self, spec: JobSpec, output_dir: str, ds_config: dict[str, Any], cuda: bool, liger: dict[str, bool] | None, parallelism_config=None):
        return kto_arguments(spec, output_dir, ds_config, cuda, liger)  # [parallel] with KTO is refused at validate

    def describe_data(self, spec: JobSpec, dataset) -> str:
        return f"off (KTO: {len(dataset)} labelled completions, each micro-batch padded to its longest sequence)"

    def trainer(self, spec: JobSpec, cuda: bool, attn: str, **kwargs):
        ref_model, peft_config = reference_and_adapter(spec, cuda, attn, kwargs.get("model"))
        kwargs.pop("data_collator", None)
        return trainer_class()(ref_model=ref_model, peft_config=peft_config, **kwargs)
