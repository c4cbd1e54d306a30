"""Evaluation keys of [train]: the cross-field rules, and which way a metric improves.

Pure. ``eval_problems`` is called by ``TrainTable._cross``; ``greater_is_better`` and ``metric_key`` are shared by
the trainer (``train/evaluation.py``: the best checkpoint, early stopping) and `status --sort` (``watch/``), so the
spec, the trainer and the sweep table agree on what "better" means for a metric's name.
"""

from __future__ import annotations

import re
from typing import Any

from ..tasks import TASKS

EVAL_KEYS = ("eval_steps", "per_device_eval_batch_size", "metric_for_best_model", "greater_is_better", "early_stopping_patience")
# names a lower value of is better: HF's rule (a name ending in "loss") and the obvious others (times, perplexity)
_LOWER = re.compile(r"(loss|perplexity|ppl|error|runtime|time|(?<!per)_s)$")
_METRIC_RE = re.compile(r"[A-Za-z0-9_./-]+")


def metric_key(name: str) -> str:
    """The key evaluation logs a metric under: ``eval_loss`` for ``loss`` or ``eval_loss`` (as HF resolves it)."""
    return name if name.startswith("eval_") else f"eval_{name}"


def greater_is_better(name: str) -> bool:
    """Whether a higher value of the metric ``name`` is better: lower for losses, perplexity, errors and times
    (``eval_loss``, ``train_runtime``, ``step_time_s``), higher for the rest (accuracies, rewards, tokens/s)."""
    return not _LOWER.search(name.lower())


def evaluates(t: Any) -> bool:
    """Whether a [train] table holds out an eval set (files or a split)."""
    return bool(t.eval_dataset) or t.eval_split > 0


def split_counts(n: int, ratio: float) -> tuple[int, int]:
    """(training records, eval records) that ``train.eval_split = ratio`` makes of ``n`` records: ``round(n * ratio)``
    held out, at least 1 and at most ``n - 1`` (``n >= 2``). The trainer's split draws exactly this many."""
    held = min(max(1, round(n * ratio)), n - 1)
    return n - held, held


def split_problem(n: int, ratio: float, global_batch: int) -> tuple[str, str, str] | None:
    """What, found, hint when ``train.eval_split`` cannot leave a training set: under 2 records, or fewer training
    records than one optimizer step takes (the ranks' samplers would repeat the few left within every step)."""
    hint = "lower train.eval_split, add records to train.dataset, or give train.eval_dataset files"
    if n < 2:
        return ("train.eval_split needs at least 2 records (one to train on, one to evaluate)",
                f"{n} record(s) in train.dataset", "add records, or give train.eval_dataset files")
    train, held = split_counts(n, ratio)
    if train < global_batch:
        return ("train.eval_split leaves fewer training records than one optimizer step takes",
                f"{n} record(s): {held} held out for evaluation by eval_split = {ratio}, {train} left to train on; one step "
                f"takes {global_batch} (per_device_train_batch_size x gradient_accumulation_steps x data-parallel ranks)", hint)
    return None


def _changed(t: Any, keys: tuple[str, ...]) -> list[str]:
    return [k for k in keys if getattr(t, k) != type(t).model_fields[k].default]


def eval_problems(t: Any) -> list[str]:
    """Every cross-field problem of the evaluation keys of a [train] table."""
    out: list[str] = []
    if t.eval_dataset and t.eval_split > 0:
        out.append("eval_dataset and eval_split are both set: the eval set is either your files or a split of "
                   "train.dataset. HINT: drop one of them")
    set_keys = _changed(t, EVAL_KEYS)
    if set_keys and not evaluates(t):
        out.append(f"{', '.join(set_keys)} set without an eval set: they configure evaluation. HINT: set "
                   "train.eval_split = 0.05 (5% of train.dataset held out, a fixed seed) or train.eval_dataset = [files]")
    if evaluates(t) and t.command:
        out.append("eval_dataset/eval_split configure the built-in trainer; train.command runs your own script, which "
                   "evaluates itself. HINT: drop the eval keys, or train.command")
    name = t.metric_for_best_model
    if not _METRIC_RE.fullmatch(name):
        out.append(f"metric_for_best_model = {name!r}: a metric's name as the logs show it, like \"eval_loss\"")
    else:
        bare = metric_key(name)[len("eval_"):]
        known = TASKS[t.task].eval_metrics  # what the task's evaluation reports; None: any name
        if known is not None and not any(bare == k or (k.endswith("/") and bare.startswith(k)) for k in known):
            out.append(f"metric_for_best_model = {name!r}: task = {t.task!r} evaluation reports "
                       f"{', '.join('eval_' + k + ('...' if k.endswith('/') else '') for k in known)}. HINT: "
                       "metric_for_best_model = \"eval_loss\"")
    return out
