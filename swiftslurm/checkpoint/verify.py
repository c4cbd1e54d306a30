"""Verify a checkpoint directory against its manifest, naming every file that is wrong and how.

A checkpoint is verified when, and only when: its manifest parses and its body checksum matches (not
edited), the manifest's step matches the directory name, every listed file exists with the listed size
and checksum, and no file exists that the manifest does not list.
"""

from __future__ import annotations

import stat
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .cache import forget, is_remembered, remember_verified
from .manifest import MANIFEST_NAME, Manifest, ManifestError, describe_os_error, file_kind, hash_files, read_manifest, walk_files
from .names import step_of

# progress(done_bytes, total_bytes): called from worker threads, under a lock, as bytes are hashed.
VerifyProgress = Callable[[int, int], None]


@dataclass
class VerifyResult:
    path: Path
    ok: bool
    problems: list[str] = field(default_factory=list)
    manifest: Manifest | None = None
    seconds: float = 0.0

    @property
    def step(self) -> int | None:
        return self.manifest.step if self.manifest is not None else step_of(self.path)

    @property
    def total_bytes(self) -> int:
        return self.manifest.total_bytes if self.manifest is not None else 0

    def summary(self) -> str:
        return "verified" if self.ok else "; ".join(self.problems)


def inspect(path: Path) -> tuple[Manifest | None, list[str], list[str]]:
    """Everything of ``verify`` but the hashing (stats only, cheap): ``(manifest, problems, to_hash)``, where
    ``to_hash`` are the listed files present as regular files of the listed sizes."""
    if not path.is_dir():
        return None, [f"{path}: not a directory"], []
    try:
        manifest = read_manifest(path)
    except ManifestError as exc:
        return None, [f"{MANIFEST_NAME}: {exc}"], []
    problems: list[str] = []
    dir_step = step_of(path)
    if dir_step is not None and dir_step != manifest.step:
        problems.append(f"{MANIFEST_NAME}: says step {manifest.step} but the directory is {path.name}")
    on_disk = set(walk_files(path)) - {MANIFEST_NAME}
    for rel in sorted(on_disk - set(manifest.files)):
        problems.append(f"{rel}: extra file, not in the manifest")
    to_hash = []
    for rel, entry in sorted(manifest.files.items()):
        if rel not in on_disk:
            problems.append(f"{rel}: " + ("a directory where the manifest lists a file" if (path / rel).is_dir() else "missing"))
            continue
        try:
            st = (path / rel).stat()
        except OSError as exc:
            problems.append(f"{rel}: {describe_os_error(path / rel, exc)}")
            continue
        if not stat.S_ISREG(st.st_mode):
            problems.append(f"{rel}: {file_kind(st.st_mode)}, not a regular file")
            continue
        if st.st_size != int(entry["size"]):
            problems.append(f"{rel}: size {st.st_size} bytes, manifest says {entry['size']} (truncated or overwritten)")
            continue
        to_hash.append(rel)
    return manifest, problems, to_hash


def hash_problems(path: Path, algo: str, files: dict[str, dict], progress: VerifyProgress | None = None,
                  workers: int = 4) -> list[str]:
    """Hash ``files`` (``{rel: {size, checksum}}`` from a manifest) under ``path``; what does not match, or
    cannot be read, one line each. The hashing half of ``verify``; a rank's share in ``split.verified_split``."""
    total = sum(int(e["size"]) for e in files.values())
    done = [0]
    lock = threading.Lock()

    def tick(n: int) -> None:
        with lock:
            done[0] += n
            progress(done[0], total)  # type: ignore[misc]

    unreadable: dict[str, str] = {}
    actual = hash_files(path, list(files), algo, workers=workers, progress=tick if progress else None, errors=unreadable)
    problems = []
    for rel in sorted(files):
        if rel in unreadable:
            problems.append(f"{rel}: {unreadable[rel]}")
        elif actual[rel]["size"] != int(files[rel]["size"]):
            problems.append(f"{rel}: read {actual[rel]['size']} bytes, manifest says {files[rel]['size']} (changed while verifying)")
        elif actual[rel]["checksum"] != files[rel]["checksum"]:
            problems.append(f"{rel}: {algo} checksum mismatch (content changed)")
    return problems


def verify(path: Path | str, progress: VerifyProgress | None = None, workers: int = 4, contents: bool = True) -> VerifyResult:
    """Check ``path`` against its manifest. Never raises for damage: it is reported in ``problems``, and so is
    a file that cannot be read (dangling symlink, FIFO or directory in its place, EIO, EACCES): named with
    its error, it makes the checkpoint damaged, so resume falls back to an older one.

    ``contents=False`` stops before hashing (``inspect``): the manifest, the file list and every file's size
    (seconds at any size; what ``status`` shows). Resume and ``swiftslurm verify`` always hash."""
    path = Path(path)
    t0 = time.monotonic()
    manifest, problems, to_hash = inspect(path)
    if manifest is not None and contents:
        files = {rel: manifest.files[rel] for rel in to_hash}
        problems += hash_problems(path, manifest.algo, files, progress, workers)
    return VerifyResult(path, not problems, problems, manifest, time.monotonic() - t0)


# ---------------------------------------------------------------- a per-process cache for retention
# prune runs after every save; re-hashing `keep` checkpoints each time would dominate save time. A
# checkpoint fully verified (or committed) by THIS process is trusted again while no file under it
# changed size, mtime or inode. Resume (newest_verified) never uses the cache: it always re-hashes, and
# remembers what it verified, so the first prune of the job does not hash that checkpoint again.


def verify_cached(path: Path | str) -> bool:
    """True if ``path`` verifies; skips hashing when this process verified it and nothing changed since."""
    if is_remembered(path):
        return True
    result = verify(path)
    if result.ok:
        remember_verified(path)
    else:
        forget(path)
    return result.ok
