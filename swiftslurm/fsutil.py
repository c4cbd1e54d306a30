"""The one atomic file write: readers see the old content or the new, never a mix.

Used for everything several processes or a later rerun read back: the plan, submission records,
requeue records, the preflight report, the training summary, checkpoint manifests and ``latest``.
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: Path, directory: bool = False) -> None:
    fd = os.open(path, (os.O_RDONLY | os.O_DIRECTORY) if directory else os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path``: write a temporary sibling, fsync, rename over ``path``, fsync the directory."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent, directory=True)
