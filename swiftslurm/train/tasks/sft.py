"""The SFT task (``train.task = "sft"``): prompt/response records, the loss on the response, packed rows or
padded micro-batches; our Trainer (``trainer.py``) as is. ``pt.PTTask`` is this task on raw text.

A task is what differs between tasks, behind the one seam of ``run.train``: the arguments, the data and the Trainer
class (registered in ``tasks/__init__.py``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...taskdir import TOKEN_CACHE_DIR as CACHE_DIR  # under output_dir: a requeue finds the tokens there
from ...taskdir import VL_LENGTHS_DIR
from ..build import _apply_lora, training_arguments

if TYPE_CHECKING:
    from ...spec.model import JobSpec

log = logging.getLogger("swiftslurm.train")


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
    its row of ``swiftslurm/tasks.py`` (``eval_metrics``), which ``metric_for_best_model`` is checked against."""

    name = "sft"

    def arguments(self, spec: JobSpec, output_dir: str, ds_config: dict[str, Any], cuda: bool, liger: dict[str, bool] | None, parallelism_config=None):
        return training_arguments(spec, output_dir, ds_config, cuda, liger, parallelism_config)

    def prepare_model(self, model, spec: JobSpec):
        from ..vision import freeze

        freeze(model, spec.train.freeze_vision, spec.train.freeze_projector)  # a vision-language model's tower, projector
        if spec.train.train_type == "lora":
            model = _apply_lora(model, spec.train)
            if spec.train.gradient_checkpointing:
                model.enable_input_require_grads()
        return model

    def data(self, spec: JobSpec, args, tok, model, attn: str, output_dir: str):
        """``tok``: the processing class; a vision-language model's processor reads records with images
        (``data/vision.py``)."""
        from ..vision import is_multimodal

        if is_multimodal(tok):
            from ..data.vision import vision_data

            return vision_data(spec, tok, model, attn, Path(output_dir) / VL_LENGTHS_DIR,
                               lambda: args.main_process_first(local=False, desc="counting the vision-language records"))
        return _data(spec, args, tok, model, attn, output_dir, self.name)

    def describe_data(self, spec: JobSpec, dataset) -> str:
        return (f"on: {len(dataset)} rows of {spec.train.max_length} tokens, {dataset.padding_ratio():.1%} padding"
                if spec.train.packing else "off (each micro-batch padded to its longest sample)")

    def trainer(self, spec: JobSpec, cuda: bool, attn: str, **kwargs):
        from ..trainer import SwiftTrainer

        return SwiftTrainer(**kwargs)


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
