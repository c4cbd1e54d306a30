"""Continued pretraining on raw text (``train.task = "pt"``), behind ``run.train``'s task seam.

Everything is SFT's: the Trainer, packing, LoRA or full fine-tuning, sequence/tensor parallel, Liger, resume,
verified checkpoints, the walltime stop, the metrics and the summary. Only the data differs: ``{"text"}``
records tokenized without a chat template, EOS at each document's end, every token a label, long documents cut
into ``max_length`` pieces (``data.text``), cached under their own key (``data.cache``) and packed into full
rows with document boundaries kept (``data.packing``) unless ``train.packing = false``.
"""

from __future__ import annotations

from .sft import SFTTask


class PTTask(SFTTask):
    """``sft.SFTTask`` on raw text: ``data`` passes ``name`` to the token cache, which picks ``data.text``."""

    name = "pt"
