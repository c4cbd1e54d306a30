"""The manifest of a checkpoint: every file with its size and checksum, plus what the run needs to resume.

``manifest.json`` (written last by ``commit``) looks like::

    {"format": "swiftslurm-checkpoint", "version": 2, "algo": "xxh3_128", "step": 12,
     "meta": {"world_size": 2, "seed": 42, "data_position": ..., "versions": {...}},
     "files": {"global_step12/mp_rank_00_model_states.pt": {"size": 123, "checksum": "9f..."}, ...},
     "body_checksum": "<sha256 of the canonical JSON of everything above>"}

``body_checksum`` lets ``verify`` tell an edited (or truncated) manifest from a damaged data file.
``version`` is the schema version (``versions.py``: older ones load, a newer one is refused by number).
Hashing is parallel over files (a thread pool: xxhash and hashlib release the GIL on large buffers).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import xxhash

from ..fsutil import MANIFEST_CAP, NotRegularFile, Unreadable, describe_os_error, file_kind, loads_json, open_regular, read_text  # noqa: F401 -- re-exported
from .versions import MANIFEST_VERSION, UnsupportedVersion, upgrade, version_of, writer_fields

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "swiftslurm-checkpoint"  # versions.FORMAT_NAME: the manifest of a checkpoint or an export of ours
CHUNK_BYTES = 1 << 20  # 1 MiB reads: release the GIL, and stay in L2 cache between the copy and the hash (4 MiB was ~15% slower)

# spec.checkpoint.checksum names -> the algorithm recorded in manifests. "xxh3" is XXH3-128.
ALGOS: dict[str, Callable[[], Any]] = {
    "xxh3_128": xxhash.xxh3_128,
    "md5": hashlib.md5,
    "sha256": hashlib.sha256,
}
ALIASES = {"xxh3": "xxh3_128"}

Progress = Callable[[int], None]  # called with the number of bytes just hashed (from worker threads)


def algo_name(algo: str) -> str:
    """The canonical name of a checksum algorithm ('xxh3' -> 'xxh3_128'); ValueError for an unknown one."""
    name = ALIASES.get(algo, algo)
    if name not in ALGOS:
        raise ValueError(f"unknown checksum algorithm {algo!r}; choose xxh3, md5 or sha256")
    return name


def walk_files(root: Path) -> list[str]:
    """Every regular file under ``root`` as a sorted POSIX relative path (symlinks to files count as files)."""
    out = []
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            full = Path(dirpath) / name
            out.append(full.relative_to(root).as_posix())
    return sorted(out)


def read_file(path: Path, algo: str | None, progress: Progress | None = None, buf: bytearray | None = None) -> dict:
    """Read one file in chunks with ``readinto``; hash it with ``algo`` (None = only read). {size, checksum}.

    Always ``read()`` into a buffer, never ``mmap``: an I/O error on a mapped page is a SIGBUS that kills the
    process, where ``read()`` raises an OSError that verify reports as damage.
    """
    hasher = ALGOS[algo_name(algo)]() if algo else None
    buf = buf if buf is not None else bytearray(CHUNK_BYTES)
    view = memoryview(buf)
    size = 0
    with open_regular(path) as f:
        while True:
            n = f.readinto(view)
            if not n:
                break
            if hasher is not None:
                hasher.update(view[:n])
            size += n
            if progress is not None:
                progress(n)
    return {"size": size, "checksum": hasher.hexdigest() if hasher else ""}


def hash_file(path: Path, algo: str, progress: Progress | None = None, buf: bytearray | None = None) -> dict:
    """Hash one file (``read_file`` with an algorithm)."""
    return read_file(path, algo, progress, buf)


def _size_or_zero(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def hash_files(
    root: Path | str,
    rel_paths: list[str] | None,
    algo: str,
    workers: int = 4,
    progress: Progress | None = None,
    errors: dict[str, str] | None = None,
) -> dict[str, dict]:
    """``{rel: {"size": int, "checksum": hex}}`` for ``rel_paths`` under ``root`` (None = every file).

    Files are hashed in parallel, largest first, so one big shard does not finish last alone.
    A file that cannot be read raises its OSError, unless ``errors`` is given: then it is left out of the
    result and ``errors[rel]`` says why (``describe_os_error``), and every other file is still hashed.
    """
    root = Path(root)
    rels = walk_files(root) if rel_paths is None else sorted(set(rel_paths))
    algo = algo_name(algo)
    rels_by_size = sorted(rels, key=lambda r: -_size_or_zero(root / r))
    local = threading.local()

    def one(rel: str) -> tuple[str, dict | str]:
        if not hasattr(local, "buf"):
            local.buf = bytearray(CHUNK_BYTES)
        try:
            return rel, hash_file(root / rel, algo, progress, local.buf)
        except OSError as exc:
            if errors is None:
                raise
            return rel, describe_os_error(root / rel, exc)

    if workers <= 1 or len(rels) <= 1:
        results = [one(r) for r in rels_by_size]
    else:
        with ThreadPoolExecutor(max_workers=min(workers, len(rels))) as pool:
            results = list(pool.map(one, rels_by_size))
    out = {}
    for rel, value in sorted(results):
        if isinstance(value, str):
            errors[rel] = value  # type: ignore[index]
        else:
            out[rel] = value
    return out


def body_checksum(body: dict) -> str:
    """sha256 of the canonical JSON of a manifest body (everything but ``body_checksum``)."""
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


@dataclass(frozen=True)
class Manifest:
    step: int
    algo: str
    files: dict[str, dict]
    meta: dict = field(default_factory=dict)
    version: int = MANIFEST_VERSION  # the schema version it was read in (written: always MANIFEST_VERSION)

    @property
    def total_bytes(self) -> int:
        return sum(int(f["size"]) for f in self.files.values())

    def body(self) -> dict:
        return {**writer_fields(), "algo": self.algo, "step": self.step, "meta": self.meta, "files": self.files}

    def to_json(self) -> str:
        body = self.body()
        return json.dumps({**body, "body_checksum": body_checksum(body)}, indent=1, sort_keys=True) + "\n"


class ManifestError(ValueError):
    """A manifest that cannot be trusted; the message says why (for verify's problem list)."""


def parse_manifest(text: str) -> Manifest:
    """A Manifest from ``manifest.json`` text, or ManifestError: not JSON, wrong shape, or edited."""
    try:  # bounded: depth, finite numbers, int64 (a size of Infinity or 401 digits is damage, not a size)
        data = loads_json(text)
    except Unreadable as exc:
        raise ManifestError(exc.why) from None
    if not isinstance(data, dict):
        raise ManifestError(f"not a swiftslurm manifest (a JSON {type(data).__name__}, not an object)")
    try:
        version = version_of(data)
    except UnsupportedVersion as exc:
        raise ManifestError(str(exc)) from None
    stated = data.pop("body_checksum", None)
    if stated is None:
        raise ManifestError("no body_checksum field")
    if body_checksum(data) != stated:
        raise ManifestError("edited or corrupted: its body checksum does not match")
    data = upgrade(data, version)
    try:
        files, step, meta = data["files"], data["step"], data.get("meta") or {}
        if not isinstance(files, dict) or not isinstance(meta, dict) or not _count(step):
            raise ValueError("files, step or meta of another kind")
        for rel, entry in files.items():
            if not _inside_name(rel):
                raise ValueError(f"file name {rel[:200]!r} leaves the checkpoint")
            if not (isinstance(entry, dict) and _count(entry.get("size")) and isinstance(entry.get("checksum"), str)):
                raise ValueError(f"entry of {rel[:200]!r} is not a size and a checksum")
        return Manifest(step=step, algo=algo_name(data["algo"]), files=files, meta=meta, version=version)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ManifestError(f"malformed ({type(exc).__name__}: {exc})") from None


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _inside_name(rel: str) -> bool:
    """A file name relative to the checkpoint that stays in it: no absolute path, no ``..``, no empty part."""
    parts = rel.split("/")
    return bool(rel) and not rel.startswith("/") and all(p not in ("", ".", "..") for p in parts) and "\0" not in rel


def read_manifest(ckpt: Path) -> Manifest:
    path = Path(ckpt) / MANIFEST_NAME
    try:  # a regular file under MANIFEST_CAP (never read whole when bigger, never a FIFO)
        text = read_text(path, MANIFEST_CAP)
    except FileNotFoundError:
        raise ManifestError("no manifest.json (never committed, or deleted)") from None
    except Unreadable as exc:
        raise ManifestError(exc.why) from None
    return parse_manifest(text)


@functools.lru_cache(maxsize=1)
def library_versions() -> dict[str, str]:
    """Versions of the libraries whose formats a checkpoint depends on (cheap: no imports of torch)."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for dist in ("swiftslurm", "torch", "deepspeed", "transformers", "peft", "accelerate"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            pass
    return out


def sealing_dir(path: str | Path) -> Path | None:
    """The directory a manifest of ours seals (a committed checkpoint or an export: every file listed with its
    checksum) that ``path`` would be written into, or None. A parent's ``manifest.json`` counts when it names our
    format (another tool's file of that name does not)."""
    from ..fsutil import read_bytes

    for parent in Path(os.path.abspath(path)).parents:
        try:
            raw = read_bytes(parent / MANIFEST_NAME, MANIFEST_CAP, follow_symlinks=False)
        except (OSError, Unreadable):
            continue
        if f'"format": "{MANIFEST_FORMAT}'.encode() in raw:
            return parent
    return None


def refuse_inside_sealed(path: str | Path) -> None:
    """A file the user names for us to write (``plot -o``, ``render -o``, ``preflight --json``) never goes into a
    committed checkpoint or an export: it would no longer verify (``fsutil.Unwritable``, as for a link there)."""
    from ..fsutil import Unwritable

    sealed = sealing_dir(path)
    if sealed is not None:
        raise Unwritable(path, f"inside {sealed}, which its manifest seals (a committed checkpoint or an export): a file written there "
                               "would make it fail verification; write it outside")

