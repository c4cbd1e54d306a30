"""Checkpoint directory names: ``checkpoint-<step>``, its staging and deleting names, ``latest``. Pure."""

from __future__ import annotations

import re
from pathlib import Path

STAGING_PREFIX = ".staging-"
DELETING_PREFIX = ".deleting-"
CKPT_RE = re.compile(r"^checkpoint-(\d+)$")
LATEST_NAME = "latest"


def staging_dir(output_dir: Path | str, step: int) -> Path:
    return Path(output_dir) / f"{STAGING_PREFIX}checkpoint-{int(step)}"


def final_dir(output_dir: Path | str, step: int) -> Path:
    return Path(output_dir) / f"checkpoint-{int(step)}"


def step_of(path: Path | str) -> int | None:
    """The step in a ``checkpoint-<step>`` directory name, else None."""
    m = CKPT_RE.fullmatch(Path(path).name)
    return int(m.group(1)) if m else None
