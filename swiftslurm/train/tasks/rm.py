"""Reward models (``train.task = "rm"``) through TRL's ``RewardTrainer``, behind ``run.train``'s task seam.

Everything the run owns (``run.py``) stays shared: resume agreement, verified checkpoints, the walltime stop,
measured metrics, metrics.jsonl and the summary (``run.train``, ``trainer.SwiftTrainer``). This module adds:

- the model: ``build.load_model_and_tokenizer`` gives the backbone a 1-output score head
  (``AutoModelForSequenceClassification``, ``num_labels = 1``) when ``task = "rm"``;
- the arguments: TRL's ``RewardConfig`` = the SFT ``TrainingArguments`` keys + ``max_length`` (longer pairs are
  dropped by TRL, never cut: a cut answer would be scored as another answer);
- the data: ``preference.load``, the DPO pairs (prompt/chosen/rejected); TRL tokenizes prompt + chosen and
  prompt + rejected and scores both in one forward (its ``DataCollatorForPreference``);
- LoRA: TRL wraps the model from a SEQ_CLS ``LoraConfig`` whose ``modules_to_save`` holds the score head, so the
  head trains whole and is saved in the adapter;
- the metrics: TRL's ``accuracy`` (chosen scored above rejected) and ``margin`` (mean chosen - rejected score),
  ``min_reward``/``mean_reward``/``max_reward``, logged by the same ``log`` that feeds TensorBoard and metrics.jsonl.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .trl_task import TRLTask

if TYPE_CHECKING:
    from ...spec.model import JobSpec

SCORE_HEAD = "score"  # transformers' name of the sequence-classification head of decoder models (Llama, Qwen, Mistral, ...)


def rm_arguments(spec: JobSpec, output_dir: str, ds_config: dict[str, Any], cuda: bool, liger: dict[str, bool] | None):
    from trl import RewardConfig

    from ..build import training_kwargs

    t = spec.train
    return RewardConfig(
        **training_kwargs(spec, output_dir, ds_config, cuda, liger),
        max_length=t.max_length,
        dataset_num_proc=t.dataset_num_proc if t.dataset_num_proc > 1 else None,
    )


def trainer_class():
    """``SwiftRewardTrainer``: our Trainer plumbing (``SwiftTrainer``) in front of TRL's ``RewardTrainer`` in the MRO."""
    from trl import RewardTrainer

    from ..trainer import SwiftTrainer

    class SwiftRewardTrainer(SwiftTrainer, RewardTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.after_trl_init()  # TRL applied LoRA (peft_config) inside __init__: count, fuse

    return SwiftRewardTrainer


class RewardTask(TRLTask):
    """``run.train``'s task seam for reward models (``sft.SFTTask`` and ``dpo.DPOTask`` are the others)."""

    name = "rm"

    def arguments(self, spec: JobSpec, output_dir: str, ds_config: dict[str, Any], cuda: bool, liger: dict[str, bool] | None, parallelism_config=None):
        return rm_arguments(spec, output_dir, ds_config, cuda, liger)  # [parallel] with rm is refused at validate

    def describe_data(self, spec: JobSpec, dataset) -> str:
        return f"off (reward model: {len(dataset)} preference pairs, each micro-batch padded to its longest sequence)"

    def trainer(self, spec: JobSpec, cuda: bool, attn: str, **kwargs):
        from ..build import lora_config

        t = spec.train
        peft_config = lora_config(t, "SEQ_CLS", [SCORE_HEAD], model=kwargs.get("model")) if t.train_type == "lora" else None
        kwargs.pop("data_collator", None)
        return trainer_class()(peft_config=peft_config, **kwargs)
