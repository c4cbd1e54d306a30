"""KTO (``train.task = "kto"``) through TRL's ``KTOTrainer``, behind ``sft.train``'s task seam.

Everything the SFT trainer owns stays shared: resume agreement, verified checkpoints, the walltime stop,
measured metrics, metrics.jsonl and the summary (``sft.train``, ``trainer.SFTTrainer``). This module adds:

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

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...taskdir import PREFERENCE_CACHE_DIR as CACHE_DIR  # under output_dir: the Arrow data and TRL's tokens

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
    """``SwiftKTOTrainer``: our Trainer plumbing (``SFTTrainer``) in front of TRL's ``KTOTrainer`` in the MRO."""
    from trl import KTOTrainer

    from ..trainer import SFTTrainer

    class SwiftKTOTrainer(SFTTrainer, KTOTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.count_model_flops()  # TRL applied LoRA (peft_config) inside __init__

    return SwiftKTOTrainer


class KTOTask:
    """``sft.train``'s task seam for KTO (``sft.SFTTask`` and ``dpo.DPOTask`` are others)."""

    name = "kto"

    def arguments(self, spec: JobSpec, output_dir: str, ds_config: dict[str, Any], cuda: bool, liger: dict[str, bool] | None, parallelism_config=None):
        return kto_arguments(spec, output_dir, ds_config, cuda, liger)  # [parallel] with KTO is refused at validate

    def prepare_model(self, model, spec: JobSpec):
        return model  # LoRA: TRL wraps it from peft_config, and then disables the adapter for the reference

    def data(self, spec: JobSpec, args, tok, model, attn: str, output_dir: str):
        from ..data import unpaired
        from ..data.tokens import ensure_chat_template

        ensure_chat_template(tok)
        with args.main_process_first(local=False, desc="reading the KTO data"):
            dataset = unpaired.load(list(spec.train.dataset), Path(output_dir) / CACHE_DIR)
        return dataset, None  # TRL's DataCollatorForUnpairedPreference

    def describe_data(self, spec: JobSpec, dataset) -> str:
        return f"off (KTO: {len(dataset)} labelled completions, each micro-batch padded to its longest sequence)"

    def trainer(self, spec: JobSpec, cuda: bool, attn: str, **kwargs):
        from ..build import load_model_and_tokenizer, lora_config

        t = spec.train
        ref_model, peft_config = None, None
        if t.train_type == "lora":
            peft_config = lora_config(t)
        elif not t.precompute_ref_log_probs:
            ref_model, _ = load_model_and_tokenizer(spec, cuda, attn)  # the starting weights again (see dpo.DPOTask)
        kwargs.pop("data_collator", None)
        return trainer_class()(ref_model=ref_model, peft_config=peft_config, **kwargs)
