"""Checkpoint directory names: ``checkpoint-<step>``, its staging and deleting names, ``latest``. Pure."""

from __future__ import annotations

import re
from pathlib import Path

from ..taskdir import LATEST_NAME  # noqa: F401 -- re-exported: the name of the pointer file

STAGING_PREFIX = ".staging-"
DELETING_PREFIX = ".deleting-"
CKPT_RE = re.compile(r"^checkpoint-(\d+)$")


def staging_dir(output_dir: Path | str, step: int) -> Path:
    return Path(output_dir) / f"{STAGING_PREFIX}checkpoint-{int(step)}"


def final_dir(output_dir: Path | str, step: int) -> Path:
    return Path(output_dir) / f"checkpoint-{int(step)}"


def step_of(path: Path | str) -> int | None:
    """The step in a ``checkpoint-<step>`` directory name, else None."""
    m = CKPT_RE.fullmatch(Path(path).name)
    return int(m.group(1)) if m else None


# Files one rank writes in the HF Trainer + DeepSpeed layout: rng_state_<process index>.pth,
# [bf16_]zero_pp_rank_<dp rank>_mp_rank_<mp>_{optim,model}_states.pt. Every other file is shared (rank 0 writes it).
_RANK_FILE = re.compile(r"(?:^|/)(?:rng_state_(\d+)\.pth|(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+_\w+\.pt)$")


def owner_rank(rel: str) -> int | None:
    """The rank a checkpoint file belongs to (writes, and alone loads), or None for a shared file (pure)."""
    m = _RANK_FILE.search(rel)
    return next((int(g) for g in m.groups() if g is not None), None) if m else None
