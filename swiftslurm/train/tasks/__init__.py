"""The training tasks behind ``run.train``'s one seam, by name: one module a task, one row here.

Each task class supplies the arguments, the data and the Trainer class (``sft.SFTTask`` is the model); ``TASKS``
maps ``train.task`` to where its class lives (the runtime half of the registry; the static half,
one row a task in the same order, is ``swiftslurm/tasks.py``), imported only when that task runs (TRL loads only for its tasks).
"""

from __future__ import annotations

import importlib
from typing import Any

TASKS: dict[str, tuple[str, str]] = {  # train.task -> (module in this package, class)
    "sft": ("sft", "SFTTask"),
    "dpo": ("dpo", "DPOTask"),
    "pt": ("pt", "PTTask"),
    "rm": ("rm", "RewardTask"),
    "kto": ("kto", "KTOTask"),
    "grpo": ("grpo", "GRPOTask"),
}


def task_for(name: str) -> Any:
    """A new instance of the task class registered as ``name``."""
    module, cls = TASKS[name]
    return getattr(importlib.import_module(f".{module}", __name__), cls)()
