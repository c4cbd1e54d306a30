"""What this process has verified: a checkpoint's file fingerprints (name, size, mtime, inode) when it passed.

``commit`` remembers what it sealed; ``verify_cached`` skips re-hashing a checkpoint whose fingerprint is
unchanged since. Per process, in memory: a new process (a requeued job) verifies from scratch.
"""

from __future__ import annotations

from pathlib import Path

from .manifest import walk_files

_fingerprints: dict[str, tuple] = {}


def _fingerprint(path: Path) -> tuple:
    out = []
    for rel in walk_files(path):
        st = (path / rel).stat()
        out.append((rel, st.st_size, st.st_mtime_ns, st.st_ino))
    return tuple(out)


def remember_verified(path: Path | str) -> None:
    path = Path(path)
    _fingerprints[str(path.resolve())] = _fingerprint(path)


def forget(path: Path | str) -> None:
    _fingerprints.pop(str(Path(path).resolve()), None)


def is_remembered(path: Path | str) -> bool:
    """True when ``path`` was verified (or committed) by this process and no file changed since."""
    path = Path(path)
    key = str(path.resolve())
    try:
        return key in _fingerprints and _fingerprints[key] == _fingerprint(path)
    except OSError:
        return False
