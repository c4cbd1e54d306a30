"""Finding checkpoints in an output dir, choosing the one to resume from, and retention.

Resume = the newest checkpoint that verifies (``latest`` is never trusted over verification).
Retention keeps the newest ``keep`` verified checkpoints and never deletes the newest verified one, nor the
best one by the eval metric (``latest_best``, best.py: kept beside the ``keep`` newest when older). It
deletes only checkpoints of ours (a readable swiftslurm manifest): a ``checkpoint-N`` without one (an HF
Trainer run's, a copy from another tool) or with one it cannot read is reported once and kept.
Deleting renames first (``.deleting-checkpoint-N``), so a kill mid-delete never leaves a half
checkpoint under a checkpoint name.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable

from ..taskdir import LATEST_BEST_NAME
from .best import best_checkpoint
from .cache import CACHE_FILE, TMP_INFIX, forget, remember_verified
from .cache import save as save_cache
from .manifest import ManifestError, read_manifest
from .names import DELETING_PREFIX, LATEST_NAME, STAGING_PREFIX, step_of
from .verify import verify, verify_cached

# Test hook: ranks ("1" or "1,3", matched against $RANK) whose listing misses the newest checkpoint, as a
# stale directory cache of a shared filesystem does. Never set it in production.
STALE_LISTING_ENV = "SWIFTSLURM_CKPT_TEST_STALE_LISTING"


def list_checkpoints(output_dir: Path | str) -> list[Path]:
    """Committed ``checkpoint-N`` dirs under ``output_dir``, highest N first (staging dirs are never listed)."""
    out = Path(output_dir)
    if not out.is_dir():
        return []
    steps = {p: step for p in out.iterdir() if (step := step_of(p)) is not None and p.is_dir()}
    found = sorted(steps, key=lambda p: steps[p], reverse=True)
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


_reported: set[str] = set()  # foreign checkpoints this process already said it keeps


def _not_ours(ckpt: Path) -> str | None:
    """Why retention must keep ``ckpt`` whatever its age (no manifest of ours, or one it cannot read), else None.
    Always the manifest itself, never the verified cache (a file in the dir: anyone may have written it)."""
    try:
        read_manifest(ckpt)
    except ManifestError as exc:
        return str(exc)
    except OSError as exc:  # the last line of defence: unreadable is never ours to delete
        return str(exc)
    return None


def _staging_step(path: Path) -> int | None:
    return step_of(path.name[len(STAGING_PREFIX):]) if path.name.startswith(STAGING_PREFIX) else None


def prune(output_dir: Path | str, keep: int, log: Callable[[str], None] | None = print) -> list[Path]:
    """Apply retention; returns the paths removed.

    Only checkpoints of ours count (a readable swiftslurm manifest); every other ``checkpoint-N`` is kept
    and said once (``log``). Of ours, keeps the newest ``keep`` (at least 1) verified ones. Removes:
    verified ones beyond those, damaged ones older than the newest verified (newer damaged ones are left for
    inspection), staging dirs of a step at or below the newest committed one of ours (leftovers of this
    dir's killed saves), and ``.deleting-*``. Call it only on the rank that owns the dir when no save is in
    progress (the trainer calls it right after ``commit``).
    """
    out = Path(output_dir)
    keep = max(int(keep), 1)
    removed: list[Path] = []
    kept_verified: list[Path] = []
    checkpoints = []
    for ckpt in list_checkpoints(out):
        why = _not_ours(ckpt)
        if why is None:
            checkpoints.append(ckpt)
        elif str(ckpt) not in _reported and log is not None:
            _reported.add(str(ckpt))
            log(f"swiftslurm: keeping {ckpt.name}: not a checkpoint of ours ({why}); retention never deletes it")
    best = best_checkpoint(out)  # the best by the eval metric: never retention's to remove
    for ckpt in checkpoints:
        if len(kept_verified) >= keep:
            if ckpt != best:
                removed.append(ckpt)  # beyond retention: verified or not, no longer needed
        elif verify_cached(ckpt):
            kept_verified.append(ckpt)
        elif kept_verified and ckpt != best:
            removed.append(ckpt)  # damaged and older than the newest verified
    newest_step = step_of(checkpoints[0]) if checkpoints else None
    if out.is_dir():
        for p in out.iterdir():
            staged = _staging_step(p)
            if p.name.startswith((DELETING_PREFIX, f".{LATEST_NAME}.tmp.", f".{LATEST_BEST_NAME}.tmp.", CACHE_FILE + TMP_INFIX)):
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
