"""What this job has verified: a checkpoint's file fingerprints (name, size, mtime, inode) when it passed.

``commit`` remembers what it sealed; ``verify_cached`` (retention) skips re-hashing a checkpoint whose
fingerprint is unchanged since. The fingerprints live in memory and in ``<output_dir>/.swiftslurm-verified.json``
(written by the one process that commits and prunes, rank 0), so a requeued job's first ``prune`` does not
re-hash the ``keep`` checkpoints that earlier runs of the job committed: at 1 TB a checkpoint that is tens of
minutes inside the save barrier. Resume never uses this: ``newest_verified`` always re-hashes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..fsutil import atomic_write_text
from .manifest import walk_files

CACHE_FILE = ".swiftslurm-verified.json"
_fingerprints: dict[str, tuple] = {}


def _fingerprint(path: Path) -> tuple:
    out = []
    for rel in walk_files(path):
        st = (path / rel).stat()
        out.append((rel, st.st_size, st.st_mtime_ns, st.st_ino))
    return tuple(out)


def _load(out_dir: Path) -> dict[str, list]:
    try:
        data = json.loads((out_dir / CACHE_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _store(out_dir: Path, name: str, fingerprint: tuple | None) -> None:
    data = _load(out_dir)
    if fingerprint is None:
        if data.pop(name, None) is None:
            return
    else:
        data[name] = [list(entry) for entry in fingerprint]
    try:
        atomic_write_text(out_dir / CACHE_FILE, json.dumps(data))
    except OSError:  # only a cache: a read-only output dir costs a re-hash, nothing else
        pass


def remember_verified(path: Path | str) -> None:
    path = Path(path)
    fingerprint = _fingerprint(path)
    _fingerprints[str(path.resolve())] = fingerprint
    _store(path.parent, path.name, fingerprint)


def forget(path: Path | str) -> None:
    path = Path(path)
    _fingerprints.pop(str(path.resolve()), None)
    if (path.parent / CACHE_FILE).exists():
        _store(path.parent, path.name, None)


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
