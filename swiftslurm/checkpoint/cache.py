"""What this job has verified: a checkpoint's file fingerprints (name, size, mtime, inode) when it passed.

``commit`` remembers what it sealed and resume (``newest_verified``, ``verified_split``) what it verified;
``verify_cached`` (retention) skips re-hashing a checkpoint whose
fingerprint is unchanged since. The fingerprints live in memory and, saved by ``prune`` (rank 0, after each
save), in ``<output_dir>/.swiftslurm-verified.json``, so a requeued job's first ``prune`` does not re-hash the
``keep`` checkpoints that earlier runs of the job committed: at 1 TB a checkpoint that is tens of minutes
inside the save barrier. Resume never reads this: it always re-hashes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..fsutil import RECORD_CAP, read_json
from ..taskdir import VERIFIED_CACHE_FILE as CACHE_FILE
from .manifest import walk_files

TMP_INFIX = ".tmp."  # a killed save's leftover: <CACHE_FILE>.tmp.<pid>, removed by prune
_fingerprints: dict[str, tuple] = {}


def _fingerprint(path: Path) -> tuple:
    out = []
    for rel in walk_files(path):
        st = (path / rel).stat()
        out.append((rel, st.st_size, st.st_mtime_ns, st.st_ino))
    return tuple(out)


def _load(out_dir: Path) -> dict[str, list]:
    try:
        data = read_json(out_dir / CACHE_FILE, RECORD_CAP)
    except (OSError, ValueError):  # none yet, or Unreadable: nothing remembered
        return {}
    return {k: v for k, v in data.items() if isinstance(v, list)}


def remember_verified(path: Path | str) -> None:
    path = Path(path)
    _fingerprints[str(path.resolve())] = _fingerprint(path)


def forget(path: Path | str) -> None:
    _fingerprints.pop(str(Path(path).resolve()), None)


def save(out_dir: Path | str, kept: list[Path]) -> None:
    """Keep the fingerprints of ``kept`` (checkpoints of ``out_dir`` this process trusts) for later runs of the job.

    Called by ``prune``, once per save and outside the commit: only a cache, so no fsync (a torn or lost file
    costs a re-hash, nothing else), written to a temporary name and renamed.
    """
    out_dir = Path(out_dir)
    data = {}
    for ckpt in kept:
        fingerprint = _fingerprints.get(str(Path(ckpt).resolve()))
        if fingerprint is not None:
            data[Path(ckpt).name] = [list(entry) for entry in fingerprint]
    tmp = out_dir / f"{CACHE_FILE}{TMP_INFIX}{os.getpid()}"
    try:
        tmp.write_text(json.dumps(data))
        os.replace(tmp, out_dir / CACHE_FILE)
    except OSError:  # a read-only output dir costs a re-hash, nothing else
        tmp.unlink(missing_ok=True)


def is_remembered(path: Path | str) -> bool:
    """True when ``path`` was verified (or committed) in this job and no file changed since."""
    path = Path(path)
    key = str(path.resolve())
    try:
        if key not in _fingerprints:
            stored = _load(path.parent).get(path.name)
            if not stored or not os.path.isdir(path):
                return False
            _fingerprints[key] = tuple(tuple(entry) for entry in stored)
        return _fingerprints[key] == _fingerprint(path)
    except (OSError, TypeError):
        return False
