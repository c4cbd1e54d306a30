"""What the TRL-backed tasks (DPO, KTO, reward models) share behind ``run.train``'s task seam.

TRL wraps the model (LoRA from ``peft_config``), tokenizes and pads each micro-batch itself (its own collator), so
the task hands it the model as built and the checked records. ``TRLTask.data`` reads the records with the task's
loader (``data.preference`` or ``data.unpaired``) on the main process first, into the output dir's cache;
``reference_and_adapter`` is the reference model DPO and KTO score against: none with LoRA (TRL disables the adapter
for it) or with ``precompute_ref_log_probs``, else a second copy of the starting weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from ...taskdir import PREFERENCE_CACHE_DIR as CACHE_DIR  # under output_dir: the Arrow data, TRL's tokens and reference log-probs

if TYPE_CHECKING:
    from ...spec.model import JobSpec


class TRLTask:
    """The part of a TRL task's seam that is the same for each; a subclass names its records and its trainer."""

    name = ""
    records = "preference"  # the data module whose ``load`` checks this task's records: preference | unpaired
    reading = "reading the preference data"

    def prepare_model(self, model, spec: JobSpec):
        return model  # LoRA: TRL wraps it from peft_config

    def data(self, spec: JobSpec, args, tok, model, attn: str, output_dir: str):
        from ..data import preference, unpaired
        from ..data.tokens import ensure_chat_template

        load: Callable[..., Any] = {"preference": preference.load, "unpaired": unpaired.load}[self.records]
        ensure_chat_template(tok)
        with args.main_process_first(local=False, desc=self.reading):
            dataset = load(list(spec.train.dataset), Path(output_dir) / CACHE_DIR)
        if "images" in dataset.column_names:  # validate refuses these where it can tell (a hub model it cannot read)
            refuse_images_here(spec, tok, self.name)
        return dataset, None  # TRL's own collator pads each micro-batch


def refuse_images_here(spec: JobSpec, tok: Any, task: str) -> None:
    """Records with images reached a task that trains on text only, or a model whose processing class takes no images
    (a DataError, not TRL's ValueError mid-start-up): never trained without their images."""
    from ...tasks import TASKS
    from ..data.images import TEXT_MODEL_HINT, text_task_hint
    from ..data.records import DataError
    from ..vision import is_multimodal

    files = f"train.dataset = {list(spec.train.dataset)}"[:160]
    if not TASKS[task].images:
        raise DataError(f"records with images, and train.task = {task!r} trains on text only", files, text_task_hint())
    if not is_multimodal(tok):
        raise DataError(f"records with images, and train.model = {spec.train.model!r} takes text only "
                        f"({type(tok).__name__})", files, TEXT_MODEL_HINT)


def reference_and_adapter(spec: JobSpec, cuda: bool, attn: str, model: Any = None) -> tuple[Any, Any]:
    """(ref_model, peft_config) for TRL's DPO and KTO trainers: LoRA scores the reference with the adapter disabled;
    full fine-tuning loads a second copy of the starting weights (the same seed rebuilds tiny-llama's; under ZeRO-3
    it is loaded partitioned, as the policy was, and TRL's prepare_deepspeed shards it with the same config), or
    none with ``precompute_ref_log_probs``."""
    from ..build import load_model_and_tokenizer, lora_config

    t = spec.train
    if t.train_type == "lora":
        return None, lora_config(t, model=model)
    if t.precompute_ref_log_probs:
        return None, None
    ref_model, _ = load_model_and_tokenizer(spec, cuda, attn)
    return ref_model, None
