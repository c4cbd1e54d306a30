"""Evaluation while training, the best checkpoint and early stopping (``train.eval_*``), for every task.

The eval set is either ``train.eval_dataset`` (files) or ``train.eval_split`` (a ratio of ``train.dataset``'s records
held out with a fixed seed, ``SPLIT_SEED``, the same for every run and sweep task, so their eval losses compare).
The split is made here, on records, before any task reads them: :func:`split_files` writes the two parts as JSONL
under the output dir (keyed by the files' content, the ratio and the seed: a requeue finds them), and the task's
``data()`` is called once with the training part and once with the eval part, each through a copy of the spec whose
``train.dataset`` names it. So the eval set is tokenized and cached like the training set, packing applies to it,
and a new task gets evaluation without a line of its own as long as its ``data()`` reads ``spec.train.dataset``
only and its ``trainer()`` hands ``eval_dataset`` on to the Trainer (the seam: ``tasks/sft.py``). A task whose
eval set is built otherwise defines ``eval_data(spec, args, tok, model, attn, output_dir) -> dataset``.

The HF Trainer evaluates every ``eval_steps`` on all ranks (each a shard, one gathered mean) and logs ``eval_loss``
(DPO: TRL's ``eval_rewards/...`` too) to TensorBoard and metrics.jsonl. On top of it:

- :class:`BestCheckpoint`: an evaluation that beats the best so far saves a checkpoint at its step, so the best
  always has one; the trainer points ``latest_best`` at it after the commit (``checkpoint/best.py``) and retention
  keeps it. ``eval_steps`` defaults to ``save_steps``: then no save is added.
- :class:`EarlyStop`: HF's ``EarlyStoppingCallback`` whose counter survives a requeue (HF restores callback state
  only with ``restore_callback_states_from_checkpoint``, which would also restore the ``TrainerControl`` of the
  save, a walltime stop's ``should_training_stop`` included); the best so far is the Trainer state's ``best_metric``
  (trainer_state.json, restored by every resume). A stop for patience saves at its step and names its reason.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..spec.eval_rules import evaluates, greater_is_better, metric_key, split_counts, split_problem
from ..taskdir import SPLIT_CACHE_DIR
from .data.records import DataError, read_records

if TYPE_CHECKING:
    from ..spec.model import JobSpec

SPLIT_SEED = 1234  # not train.seed: a sweep over seeds evaluates on the same records
SPLIT_FORMAT = 1


# ---------------------------------------------------------------- pure


def held_out(n: int, ratio: float, seed: int = SPLIT_SEED) -> set[int]:
    """The indices of ``n`` records that go to the eval set: ``round(n * ratio)`` of them, at least 1 and at most
    ``n - 1``, drawn with ``seed`` (the same ``n``, ratio and seed give the same set on every rank and run)."""
    bad = split_problem(n, ratio, 1)  # under 2 records (the batch is the validate's rule: it knows the world)
    if bad:
        raise DataError(*bad)
    return set(random.Random(seed).sample(range(n), split_counts(n, ratio)[1]))


def eval_arguments(spec: JobSpec) -> dict[str, Any]:
    """TrainingArguments keys of the evaluation ({} without an eval set): every ``eval_steps`` (default
    ``save_steps``), the eval batch (default the training one), and the metric the best checkpoint is chosen by."""
    t = spec.train
    if not evaluates(t):
        return {}
    metric = metric_key(t.metric_for_best_model)
    return {
        "eval_strategy": "steps",
        "eval_steps": t.eval_steps or t.save_steps,
        "per_device_eval_batch_size": t.per_device_eval_batch_size or t.per_device_train_batch_size,
        "metric_for_best_model": metric,
        "greater_is_better": t.greater_is_better if t.greater_is_better is not None else greater_is_better(metric),
    }


# ---------------------------------------------------------------- the eval set


def _with_dataset(spec: JobSpec, files: list[str]) -> JobSpec:
    return spec.model_copy(update={"train": spec.train.model_copy(update={"dataset": list(files)})})


def split_files(paths: list[str], ratio: float, cache_root: str | Path, seed: int = SPLIT_SEED) -> tuple[Path, Path]:
    """(training part, eval part) of the records of ``paths`` as two JSONL files under ``cache_root/<key>``, the key
    over the files' content, ``ratio`` and ``seed``; made once (built under a temporary name, renamed into place)."""
    from .data.cache import dataset_digest
    from .data.vision import anchored

    h = hashlib.sha256(json.dumps({"format": SPLIT_FORMAT, "ratio": ratio, "seed": seed,
                                   "files": [dataset_digest(p, cache_root) for p in paths]}).encode())
    directory = Path(cache_root) / h.hexdigest()[:24]
    train, held = directory / "train.jsonl", directory / "eval.jsonl"
    if (directory / "meta.json").exists():
        return train, held
    n = sum(1 for p in paths for _ in read_records(p))
    chosen = held_out(n, ratio, seed)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        with open(tmp / train.name, "w", encoding="utf-8") as tr, open(tmp / held.name, "w", encoding="utf-8") as ev:
            index = 0
            for p in paths:
                for _, record in read_records(p):  # relative image paths start at the data file: anchored there
                    (ev if index in chosen else tr).write(json.dumps(anchored(record, p), ensure_ascii=False, default=str) + "\n")
                    index += 1
        (tmp / "meta.json").write_text(json.dumps({"files": paths, "ratio": ratio, "seed": seed, "records": n,
                                                   "eval_records": len(chosen)}))
        try:
            tmp.rename(directory)
        except OSError:  # another process renamed its copy first: keep that one
            if not (directory / "meta.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return train, held


def task_data(task: Any, spec: JobSpec, args: Any, tok: Any, model: Any, attn: str, output_dir: str) -> tuple[Any, Any, Any]:
    """(train dataset, collator, eval dataset or None) of ``task`` (the seam of ``tasks/sft.py``)."""
    t = spec.train
    if not evaluates(t):
        dataset, collator = task.data(spec, args, tok, model, attn, output_dir)
        return dataset, collator, None
    train_spec, eval_files = spec, list(t.eval_dataset)
    if t.eval_split > 0:
        with args.main_process_first(local=False, desc="holding out the eval split"):
            train_file, eval_file = split_files(list(t.dataset), t.eval_split, Path(output_dir) / SPLIT_CACHE_DIR)
        train_spec, eval_files = _with_dataset(spec, [str(train_file)]), [str(eval_file)]
    dataset, collator = task.data(train_spec, args, tok, model, attn, output_dir)
    eval_spec = _with_dataset(spec, eval_files)
    own = getattr(task, "eval_data", None)
    eval_dataset = own(eval_spec, args, tok, model, attn, output_dir) if own else task.data(eval_spec, args, tok, model, attn, output_dir)[0]
    return dataset, collator, eval_dataset


# ---------------------------------------------------------------- callbacks


def _improves(value: float, best: float | None, greater: bool, threshold: float = 0.0) -> bool:
    if best is None:
        return value == value  # a NaN is never the best
    return value - best > threshold if greater else best - value > threshold


def callbacks(spec: JobSpec) -> list[Any]:
    """The callbacks of the evaluation keys (none without an eval set)."""
    t = spec.train
    if not evaluates(t):
        return []
    out: list[Any] = [_best_checkpoint_class()()]
    if t.early_stopping_patience:
        out.append(_early_stop_class()(t.early_stopping_patience))
    return out


def _best_checkpoint_class():
    from transformers import TrainerCallback

    class BestCheckpoint(TrainerCallback):
        """An evaluation that beats the best so far saves a checkpoint at its step (the Trainer then records
        ``best_global_step``; the save points ``latest_best`` at it)."""

        def on_evaluate(self, args, state, control, metrics=None, **kwargs):
            value = (metrics or {}).get(args.metric_for_best_model)
            if isinstance(value, (int, float)) and _improves(float(value), state.best_metric, bool(args.greater_is_better)):
                control.should_save = True
            return control

    return BestCheckpoint


def _early_stop_class():
    from transformers import EarlyStoppingCallback

    class EarlyStop(EarlyStoppingCallback):
        """HF's early stopping, with its counter restored from the resumed checkpoint and its reason kept."""

        def __init__(self, early_stopping_patience: int = 1, early_stopping_threshold: float | None = 0.0):
            super().__init__(early_stopping_patience, early_stopping_threshold)
            self.reason = ""

        def on_train_begin(self, args, state, control, **kwargs):
            name = type(self).__name__
            saved = state.stateful_callbacks.get(name)
            saved = saved[0] if isinstance(saved, list) and saved else saved
            counter = (saved.get("attributes") or {}).get("early_stopping_patience_counter") if isinstance(saved, dict) else None
            if isinstance(counter, int) and not isinstance(counter, bool) and counter >= 0:
                self.early_stopping_patience_counter = counter
            state.stateful_callbacks.setdefault(name, self.state())  # resumed from a save made without early stopping
            return control

        def on_evaluate(self, args, state, control, metrics=None, **kwargs):
            super().on_evaluate(args, state, control, metrics or {}, **kwargs)
            if self.early_stopping_patience_counter >= self.early_stopping_patience and not self.reason:
                best = "none yet" if state.best_metric is None else f"{state.best_metric:.4f} at step {state.best_global_step}"
                self.reason = (f"early stopping: {args.metric_for_best_model} did not improve for {self.early_stopping_patience_counter} "
                               f"evaluation(s) (train.early_stopping_patience = {self.early_stopping_patience}; best {best})")
                control.should_training_stop = True
                control.should_save = True  # the state it stopped in, for a look or an export
            return control

    return EarlyStop


def stop_reason(trainer: Any) -> str:
    """Why training ended before max_steps/epochs for a reason of the evaluation ("" when it did not)."""
    return next((cb.reason for cb in trainer.callback_handler.callbacks if getattr(cb, "reason", "")), "")


def best_of(trainer: Any, output_dir: str) -> dict[str, Any]:
    """The summary's fields of the evaluation: the last eval_loss, the best metric, its step and checkpoint."""
    from ..checkpoint.best import best_checkpoint

    if not trainer.args.metric_for_best_model:
        return {}
    losses = [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]
    best = best_checkpoint(output_dir)
    return {"eval_loss": losses[-1] if losses else None, "metric_for_best_model": trainer.args.metric_for_best_model,
            "best_metric": trainer.state.best_metric, "best_step": trainer.state.best_global_step,
            "best_checkpoint": str(best) if best else None}
