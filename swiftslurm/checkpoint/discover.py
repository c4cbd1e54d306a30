"""Finding checkpoints in an output dir, choosing the one to resume from, and retention.

Resume = the newest checkpoint that verifies (``latest`` is never trusted over verification).
Retention keeps the newest ``keep`` verified checkpoints and never deletes the newest verified one.
Deleting renames first (``.deleting-checkpoint-N``), so a kill mid-delete never leaves a half
checkpoint under a checkpoint name.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable

from .names import DELETING_PREFIX, LATEST_NAME, STAGING_PREFIX, step_of
from .cache import CACHE_FILE, TMP_INFIX, forget, remember_verified, save as save_cache
from .verify import verify, verify_cached


# Test hook: ranks ("1" or "1,3", matched against $RANK) whose listing misses the newest checkpoint, as a
# stale directory cache of a shared filesystem does. Never set it in production.
STALE_LISTING_ENV = "SWIFTSLURM_CKPT_TEST_STALE_LISTING"


def list_checkpoints(output_dir: Path | str) -> list[Path]:
    """Committed ``checkpoint-N`` dirs under ``output_dir``, highest N first (staging dirs are never listed)."""
    out = Path(output_dir)
    if not out.is_dir():
        return []
    found = sorted((p for p in out.iterdir() if step_of(p) is not None and p.is_dir()), key=lambda p: step_of(p), reverse=True)
    stale = os.environ.get(STALE_LISTING_ENV, "")
    if stale and os.environ.get("RANK", "0") in stale.split(","):
        return found[1:]
    return found


def newest_verified(output_dir: Path | str, log: Callable[[str], None] | None = print) -> Path | None:
    """Newest to oldest, the first checkpoint that verifies; each damaged one skipped is logged with why."""
    log = log or (lambda _msg: None)
    for ckpt in list_checkpoints(output_dir):
        try:
            result = verify(ckpt)
        except OSError as exc:  # verify reports unreadable files itself; this is the last line of defence
            log(f"swiftslurm: skipping unreadable {ckpt.name}: {exc}")
            continue
        if result.ok:
            remember_verified(ckpt)  # hashed just now: this job's prune need not hash it again
            return ckpt
        log(f"swiftslurm: skipping damaged {ckpt.name}: {result.summary()}")
    return None


def _remove(path: Path) -> None:
    aside = path.with_name(DELETING_PREFIX + path.name)
    if aside.exists():
        shutil.rmtree(aside, ignore_errors=True)
    path.rename(aside)
    shutil.rmtree(aside, ignore_errors=True)


def _staging_step(path: Path) -> int | None:
    return step_of(path.name[len(STAGING_PREFIX):]) if path.name.startswith(STAGING_PREFIX) else None


def prune(output_dir: Path | str, keep: int) -> list[Path]:
    """Apply retention; returns the paths removed.

    Keeps the newest ``keep`` (at least 1) verified checkpoints. Removes: verified ones beyond those,
    damaged ones older than the newest verified (newer damaged ones are left for inspection), staging
    dirs of a step at or below the newest committed one (leftovers of killed saves), and ``.deleting-*``.
    Call it only when no save is in progress (the trainer calls it right after ``commit``).
    """
    out = Path(output_dir)
    keep = max(int(keep), 1)
    removed: list[Path] = []
    kept_verified: list[Path] = []
    checkpoints = list_checkpoints(out)
    for ckpt in checkpoints:
        if len(kept_verified) >= keep:
            removed.append(ckpt)  # beyond retention: verified or not, no longer needed
        elif verify_cached(ckpt):
            kept_verified.append(ckpt)
        elif kept_verified:
            removed.append(ckpt)  # damaged and older than the newest verified
    newest_step = step_of(checkpoints[0]) if checkpoints else None
    if out.is_dir():
        for p in out.iterdir():
            staged = _staging_step(p)
            if p.name.startswith((DELETING_PREFIX, f".{LATEST_NAME}.tmp.", CACHE_FILE + TMP_INFIX)):
                removed.append(p)
            elif staged is not None and newest_step is not None and staged <= newest_step:
                removed.append(p)
    for p in removed:
        if p.is_file():
            p.unlink(missing_ok=True)
        elif p.name.startswith(DELETING_PREFIX):
            shutil.rmtree(p, ignore_errors=True)
        else:
            _remove(p)
            forget(p)
    if out.is_dir() and kept_verified:
        save_cache(out, kept_verified)
    return removed
