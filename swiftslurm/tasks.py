"""The training tasks as the spec sees them: one frozen row a task, in ``TASKS`` (pure, below the spec and sizing).

The spec (``train.task``'s names and help), the rules (packing, Liger, evaluation metrics), sizing (``plan``'s memory
estimate), ``prepare``'s dataset scan and the end-of-training summary read a task's facts here instead of keeping
their own lists. The runtime half, ``train/tasks/__init__.TASKS``, maps the same names to the classes that train;
``tests/test_layout.py`` checks that both halves name the same tasks. Adding a task is one module under
``train/tasks/`` plus its row in each half (docs/ARCHITECTURE.md; ``tests/test_new_task.py`` does it).
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal


@dataclass(frozen=True)
class Task:
    name: str
    help: str  # what it trains on and through what, for train.task's description
    # the module under swiftslurm/train/data/ whose ``count_records(train_table) -> int`` checks every record of
    # train.dataset at validate (``train.dataset_scan``), and what it counts (an ``images.Scanned`` instead: the
    # count and what it found of the records' images, which ``plan`` shows)
    data: str
    counts: str = "record(s)"
    packs: bool = False  # train.packing applies: the records are packed into rows of max_length
    trl: bool = False  # trains through a TRL trainer, which scores with its own pass (no Liger, no packing)
    eval_metrics: tuple[str, ...] | None = None  # what its evaluation reports (no eval_ prefix; "x/": any x/...); None: any
    score_head: bool = False  # sizing: a 1-output score head for the LM head, chosen and rejected in one forward
    reference_copy: bool = False  # sizing: full fine-tuning holds a frozen reference copy unless precomputed
    images: bool = False  # trains vision-language models on records with images (train/vision.py); others refuse them
    summary: str = ""  # its own line of the end-of-training summary: a format string over TrainResult's fields


TASKS: dict[str, Task] = {t.name: t for t in (
    Task("sft", "supervised", data="tokens", packs=True, eval_metrics=("loss",), images=True),
    Task("dpo", "preference pairs `prompt`/`chosen`/`rejected`, through TRL's DPOTrainer", data="preference",
         counts="preference pair(s)", trl=True, eval_metrics=("loss", "rewards/", "logps/", "logits/"), images=True,
         summary="reward accuracy (chosen scored above rejected, last logged step): {reward_accuracy:.3f}"),
    Task("pt", "continued pretraining on raw `text` records: every token a label, packed; docs/training.md",
         data="text", packs=True),
    Task("rm", "a reward model with a 1-output score head, on the same pairs, through TRL's RewardTrainer",
         data="preference", counts="preference pair(s)", trl=True, score_head=True,
         summary="reward accuracy (chosen scored above rejected, last logged step): {reward_accuracy:.3f}; "
                 "margin {reward_margin:.3f}"),
    Task("kto", "unpaired `prompt`/`completion`/`label` records, through TRL's KTOTrainer", data="unpaired",
         counts="labelled completion(s)", trl=True, reference_copy=True,
         summary="reward margin (desirable minus undesirable, last logged step): {reward_margin:.3f}"),
    Task("grpo", "online RL: prompts scored by `reward_funcs`, through TRL's GRPOTrainer; docs/training.md",
         data="prompts", counts="prompt(s)", trl=True,
         summary="mean reward: first {rewards[0]:.4f} -> last {rewards[1]:.4f} (logged steps)"),
)}

if TYPE_CHECKING:
    TaskName = str
else:  # the spec's `task` field: the registered names, refused otherwise with the list (pydantic's literal_error)
    TaskName = Literal[tuple(TASKS)]


def task_help() -> str:
    """``train.task``'s description: every task with what it trains on."""
    parts = [f"`{t.name}` ({t.help})" for t in TASKS.values()]
    return ", ".join(parts[:-1]) + " or " + parts[-1]


class _NotAvailable(string.Formatter):
    """Formats a field that is None as ``n/a`` whatever its format spec (a metric never logged)."""

    def format_field(self, value: Any, format_spec: str) -> str:
        return "n/a" if value is None else super().format_field(value, format_spec)


def summary_line(task: str, fields: dict[str, Any]) -> str:
    """The task's own line of the end-of-training summary over a result's fields, or "" when it has none."""
    row = TASKS.get(task)
    return _NotAvailable().format(row.summary, **fields) if row is not None and row.summary else ""
